"""The control actor: holder membership (announce, death, restart, its own
restart) and the rules engines long-poll, on a real local Ray."""

from __future__ import annotations

import warnings

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from raykv.policy import PolicyRule
from raykv.services.control import restarted_by_ray
from raykv.services.rules_store import drop_rules
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


@ray.remote(max_restarts=1)
class _RestartProbe:
    def restarted(self) -> tuple[bool, list[str]]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            restarted = restarted_by_ray()
        return restarted, [str(w.message) for w in seen]


def test_an_actor_knows_it_was_restarted_without_rays_deprecation_warning(ray_local):
    probe = _RestartProbe.remote()
    assert ray.get(probe.restarted.remote()) == (False, [])
    ray.kill(probe, no_restart=False)
    wait_until(lambda: _restarted_answer(probe) == (True, []), timeout_s=30.0, what="the restarted probe's answer")


def _restarted_answer(probe) -> tuple[bool, list[str]] | None:
    try:
        return ray.get(probe.restarted.remote(), timeout=30)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
        return None


def test_a_control_actor_that_did_not_restart_takes_no_rules_back(services):
    rule = PolicyRule.from_dict({"name": "given", "tier": "*", "policy": "REQUEST_LEVEL"}, "rule")
    assert ray.get(services.control.restore_rules.remote(100, [rule])) is False
    assert ray.get(services.control.rules.remote()) == (0, [])


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


def _names(rules: list[PolicyRule]) -> list[str]:
    return sorted(str(r.name) for r in rules)


def _control_rules(services) -> tuple[int, list[str]]:
    version, rules = services.call_control("rules", tuple[int, list[PolicyRule]])
    return version, _names(rules)


def _crash_control(services, policy, check) -> list[list[str]]:
    """Crash the control actor (Ray restarts it in place) and wait until ``check()`` holds
    at the restarted one; the engine's rules as seen every 50 ms meanwhile."""
    restarts = policy.control_restarts  # (an earlier test of this module restarted it too)
    ray.kill(services.control, no_restart=False)
    seen: list[list[str]] = []

    def restarted() -> bool:
        seen.append(_names(policy.rules))
        # (the kill is asynchronous: until the engine saw the restart, the old actor may answer)
        return policy.control_restarts > restarts and check()

    wait_until(restarted, timeout_s=30.0, interval_s=0.05, what="the restarted control actor")
    assert policy.control_restarts == restarts + 1 and not policy.control_gone
    return seen


def test_a_control_actor_restarted_after_a_crash_keeps_rules_and_gets_back_identities(services, tmp_path):
    """A crash (Ray restarts the control actor in place with only its config): the rules
    added at run time come back from the GCS with their version, the engines' identities
    from the engines' policy polls, and the engines never run without the rule."""
    with PrimaryRegion(4, 4096) as region:
        tier = TierFactory.create_tier({"type": "fs", "root": str(tmp_path)}, region.view, services=services)
        try:
            tag = tier.identity.tag_hex
            wait_until(lambda: tag in services.identities(), timeout_s=20.0, what="the engine's identity")
            policy = services.policy
            version = services.add_rule({"name": "crash", "tier": "*", "policy": "REQUEST_LEVEL"})
            assert policy.wait_version(version, timeout=10)
            seen = _crash_control(services, policy, lambda: tag in services.identities())
            assert _control_rules(services) == (version, ["crash"])  # kept, version and all
            assert all(names == ["crash"] for names in seen), seen
            # The versions count on: the engine follows the next change at once.
            assert services.remove_rule("crash") == version + 1
            assert policy.wait_version(version + 1, timeout=10) and policy.rules == []
        finally:
            tier.shutdown()


def test_rules_the_gcs_lost_are_given_back_by_the_engines_under_later_changes(services):
    """The fallback when the GCS did not keep the rules (its write failed): each engine's
    policy poll gives back the rules it holds, and the operator's changes at the restarted
    actor are made again over any copy given back after them."""
    policy = services.policy
    version = services.add_rule({"name": "lost", "tier": "*", "policy": "REQUEST_LEVEL"})
    assert policy.wait_version(version, timeout=10)
    drop_rules(NS)  # as if the GCS write had failed
    seen = _crash_control(services, policy, lambda: _control_rules(services) == (version + 1, ["lost"]))
    assert all(names == ["lost"] for names in seen), seen
    (lost,) = policy.rules
    assert services.remove_rule("lost") == version + 2
    assert services.add_rule({"name": "late", "tier": "*", "policy": "CHUNK_LEVEL"}) == version + 3
    # Another engine's newer copy (from before the crash) comes back after those changes.
    other = PolicyRule.from_dict({"name": "other", "tier": "*", "policy": "REQUEST_LEVEL"}, "rule")
    assert ray.get(services.control.restore_rules.remote(version + 2, [lost, other])) is True
    assert _control_rules(services) == (version + 4, ["late", "other"])
    assert ray.get(services.control.restore_rules.remote(version + 2, [lost])) is False  # not newer
    assert policy.wait_version(version + 4, timeout=10) and _names(policy.rules) == ["late", "other"]
    services.remove_rule("late")
    assert services.remove_rule("other") == version + 6 and policy.wait_version(version + 6, timeout=10)


def test_rules_change_while_the_control_actor_restarts(services):
    """``add_rule`` and ``remove_rule`` made as the control actor crashes: Ray answers a
    call in flight at the crash with ``ActorUnavailableError`` (6 in 8 here without the
    retry), maybe after the old actor made it. Each names what it sets, so it is made
    again at the restarted actor, and what an answered call set is kept."""
    policy = services.policy
    names = [f"mid-restart-{i}" for i in range(3)]
    for name in names:
        ray.kill(services.control, no_restart=False)
        assert isinstance(services.add_rule({"name": name, "tier": "*", "policy": "REQUEST_LEVEL"}), int)
    wait_until(
        lambda: _names(policy.rules) == names and _control_rules(services)[1] == names,
        timeout_s=20.0,
        what="every rule at the control actor and the engine",
    )
    for name in names:
        ray.kill(services.control, no_restart=False)
        assert isinstance(services.remove_rule(name), int)
    wait_until(
        lambda: policy.rules == [] and _control_rules(services)[1] == [],
        timeout_s=20.0,
        what="every removal at the control actor and the engine",
    )


def test_an_unnamed_rule_never_replaces_another(services):
    """Rules without a name are held as ``rule-N``, the first such name no rule has."""
    assert _control_rules(services)[1] == []
    services.add_rule({"tier": "*", "policy": "REQUEST_LEVEL"})
    services.add_rule({"tier": "*", "match": {"tenant": "second"}})
    assert _control_rules(services)[1] == ["rule-0", "rule-1"]
    services.remove_rule("rule-0")
    services.add_rule({"tier": "*", "match": {"tenant": "third"}})  # was held as rule-1, replacing the second
    version, rules = services.call_control("rules", tuple[int, list[PolicyRule]])
    assert sorted((r.name, r.tenant) for r in rules) == [("rule-1", "second"), ("rule-2", "third")]
    services.remove_rule("rule-1")
    assert services.remove_rule("rule-2") == version + 2


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


def test_tiers_and_engines_started_while_the_control_actor_restarts_work(services, tmp_path):
    """A tier actor's start-up and an engine's attach read the namespace's config from the
    control actor: made as it crashes, they wait out its restart instead of failing."""
    for i in range(3):
        ray.kill(services.control, no_restart=False)
        with PrimaryRegion(4, 4096) as region:
            tier = TierFactory.create_tier(
                {"type": "fs", "root": str(tmp_path / str(i))}, region.view, services=services
            )
            try:
                keys = prefix_keys(list(range(40)), 10)
                assert TierDriver(tier).store(keys, [0, 1, 2, 3]).success
            finally:
                tier.shutdown()
        ray.kill(services.control, no_restart=False)
        assert raykv.start({"namespace": NS, "directory_shards": 2}).config.namespace == NS
