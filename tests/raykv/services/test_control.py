"""The control actor: holder membership (announce, death, restart, its own
restart) and the rules engines long-poll, on a real local Ray."""

from __future__ import annotations

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.waiting import wait_until

NS = "raykv-control-test"


@pytest.fixture(scope="module")
def services(ray_local):
    s = raykv.start({"namespace": NS, "directory_shards": 2, "holder_reconcile_s": 0.5})
    yield s
    s.shutdown()


def _restarted(actor) -> bool:
    """Whether ``actor`` answers again after a restart (it announced itself before ``ready``)."""
    try:
        return bool(ray.get(actor.ready.remote(), timeout=30))
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
        return False


def _holder_ids(services) -> set[str]:
    return {h.holder_id for h in services.holders()}


def test_holder_leaves_when_it_dies_and_returns_when_restarted(services, tmp_path):
    with PrimaryRegion(4, 4096) as region:
        tier = TierFactory.create_tier({"type": "fs", "root": str(tmp_path)}, region.view, services=services)
        try:
            holder = tier.holder_info.holder_id
            assert holder in _holder_ids(services)
            assert TierDriver(tier).store(prefix_keys(list(range(40)), 10), [0, 1, 2, 3]).success
            # a crash: Ray restarts it, and it announces itself again
            ray.kill(tier.actor, no_restart=False)
            wait_until(
                lambda: _restarted(tier.actor) and holder in _holder_ids(services),
                timeout_s=20.0,
                interval_s=0.05,
                what="the restarted root actor to be listed again",
            )
            # for good: it leaves the list (nobody asks a dead holder again)
            ray.kill(tier.actor, no_restart=True)
            wait_until(
                lambda: holder not in _holder_ids(services),
                timeout_s=20.0,
                interval_s=0.05,
                what="the dead holder to leave the list",
            )
        finally:
            tier.shutdown()


def test_holders_announce_again_to_a_restarted_control_actor(services, tmp_path):
    with PrimaryRegion(4, 4096) as region:
        tier = TierFactory.create_tier({"type": "fs", "root": str(tmp_path)}, region.view, services=services)
        try:
            holder = tier.holder_info.holder_id
            control = ray.get_actor(naming.CONTROL_ACTOR, namespace=NS)
            ray.kill(control, no_restart=False)  # restarts with an empty holder list
            wait_until(
                lambda: holder in _holder_ids(services),
                timeout_s=20.0,
                interval_s=0.05,
                what="the holder to announce itself again",
            )
        finally:
            tier.shutdown()


def test_a_control_actor_restarted_after_a_crash_gets_back_rules_and_identities(services, tmp_path):
    """A crash (Ray restarts the control actor in place) forgets the rules added at run time
    and the engines' identities: the engines' policy polls give them back, and the engines
    never run without the rule meanwhile."""
    with PrimaryRegion(4, 4096) as region:
        tier = TierFactory.create_tier({"type": "fs", "root": str(tmp_path)}, region.view, services=services)
        try:
            tag = tier.identity.tag_hex
            wait_until(lambda: tag in services.identities(), timeout_s=20.0, what="the engine's identity")
            policy = services.policy
            version = services.add_rule({"name": "crash", "tier": "*", "policy": "REQUEST_LEVEL"})
            assert policy.wait_version(version, timeout=10)
            fresh = ray.get(services.control.restore_rules.remote(version + 5, []))
            assert fresh is False  # a control actor that did not restart takes nothing

            restarts = policy.control_restarts  # (an earlier test of this module restarted it too)
            ray.kill(services.control, no_restart=False)  # a crash: Ray restarts it, empty
            seen: list[list[str | None]] = []

            def restored() -> bool:
                seen.append([r.name for r in policy.rules])
                got = ray.get(services.control.rules.remote(), timeout=30)
                return got[0] == version and [r.name for r in got[1]] == ["crash"] and tag in services.identities()

            wait_until(
                restored,
                timeout_s=30.0,
                interval_s=0.05,
                ignore=(ray.exceptions.RayActorError,),  # (ActorUnavailableError while it restarts)
                what="the rules and identity given back",
            )
            assert policy.control_restarts == restarts + 1 and not policy.control_gone
            assert all(names == ["crash"] for names in seen), seen  # the engine kept the rule throughout
            # An operator's change after the restart wins over any engine's older copy.
            assert services.remove_rule("crash") == version + 1
            assert ray.get(services.control.restore_rules.remote(version + 5, [])) is False
            assert policy.wait_version(version + 1, timeout=10) and policy.rules == []
        finally:
            tier.shutdown()


def test_rules_readers_show_the_version_engines_hold(services):
    policy = services.policy
    assert policy.wait_version(0, timeout=30)
    version = services.add_rule({"name": "r", "tier": "*", "match": {"tenant": "t"}})
    assert policy.wait_version(version, timeout=10)
    wait_until(
        lambda: version in ray.get(services.control.rules_readers.remote()),
        timeout_s=20.0,
        interval_s=0.05,
        what="the long poll to wait at the new version",
    )
    assert services.remove_rule("r") == version + 1


def test_starting_again_with_other_settings_keeps_the_running_ones_and_names_each(services, caplog) -> None:
    with caplog.at_level("WARNING", logger="raykv.services.cluster"):
        again = raykv.start({"namespace": NS, "directory_shards": 4, "holder_reconcile_s": 0.5, "lookup_wait_ms": 9})
    assert again.config.directory_shards == 2 and again.config.lookup_wait_ms == services.config.lookup_wait_ms
    (line,) = [r.getMessage() for r in caplog.records if "already runs" in r.getMessage()]
    assert line == (
        f"raykv already runs in namespace {NS!r} with other settings: directory_shards 2 (asked 4); "
        f"lookup_wait_ms {services.config.lookup_wait_ms!r} (asked 9.0); keeping them (to change them: "
        "`raykv stop`, then `raykv start`; running engines attach to the new services)"
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="raykv.services.cluster"):
        raykv.start({"namespace": NS, "directory_shards": 2, "holder_reconcile_s": 0.5})  # the same: nothing to say
    assert not [r for r in caplog.records if "already runs" in r.getMessage()]
