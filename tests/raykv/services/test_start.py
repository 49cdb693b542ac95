"""``raykv start`` / ``raykv.start``: a start that fails leaves the namespace as it found
it (what another start joined meanwhile keeps running), and starting again names what the
new config leaves out (on a real local Ray)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.errors import RaykvError
from raykv.core.named import find_actor
from raykv.services import cluster
from raykv.services.control import ControlActor
from raykv.services.messages import StartRole
from raykv.services.rules_store import clear_stopping, stopping_until
from tests.cli_run import run_raykv, spawn_raykv
from tests.waiting import wait_until


def _raykv_actors(namespace: str) -> set[str]:
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith("raykv-")
    }


def _fs(root: Path) -> dict[str, object]:
    return {"type": "fs", "root": str(root)}


def _unmounted(tmp_path: Path) -> Path:
    """A root whose parent does not exist yet (a shared filesystem not mounted)."""
    return tmp_path / "mnt" / "kv"


def test_a_first_start_that_fails_leaves_nothing_running(ray_local, tmp_path, caplog) -> None:
    namespace = "raykv-start-fails-first"
    config = {"namespace": namespace, "tiers": [_fs(tmp_path / "good"), _fs(_unmounted(tmp_path))]}
    with caplog.at_level("WARNING", logger="raykv.services.cluster"):
        with pytest.raises(RaykvError, match=r"fs tier root .*the root actor did not start: .*does not exist"):
            raykv.start(config)
    assert "stopped what it had started in namespace 'raykv-start-fails-first'" in caplog.text
    wait_until(lambda: not _raykv_actors(namespace), timeout_s=20, what="every raykv actor to be gone")
    time.sleep(2.0)  # nothing comes back behind the cleanup (a dying actor's start-up task)
    assert _raykv_actors(namespace) == set()
    with pytest.raises(RaykvError, match="raykv is not running"):
        raykv.attach(namespace)
    (tmp_path / "mnt").mkdir()  # once mounted, the same config starts
    services = raykv.start(config)
    try:
        assert {naming.CONTROL_ACTOR, naming.directory_shard(0)} <= _raykv_actors(namespace)
    finally:
        services.shutdown()


def test_a_failed_start_of_a_running_raykv_keeps_it_and_a_later_start_works(ray_local, tmp_path) -> None:
    namespace = "raykv-start-fails-again"
    raykv.start({"namespace": namespace})
    try:
        bad = {"namespace": namespace, "tiers": [_fs(_unmounted(tmp_path))]}
        with pytest.raises(RaykvError, match="the root actor did not start"):
            raykv.start(bad)
        assert raykv.attach(namespace).control_stats().holders == 0  # the running services kept
        (tmp_path / "mnt").mkdir()
        again = raykv.start(bad)
        assert [h.tier_type for h in again.holders()] == ["fs"]
    finally:
        raykv.stop(namespace)


def test_starting_again_names_the_running_tiers_the_config_leaves_out(ray_local, tmp_path, caplog) -> None:
    namespace = "raykv-start-left-out"
    first, second = _fs(tmp_path / "a"), _fs(tmp_path / "b")
    raykv.start({"namespace": namespace, "tiers": [first]})
    try:
        with caplog.at_level("WARNING", logger="raykv.services.cluster"):
            services = raykv.start({"namespace": namespace, "tiers": [second]})
        (line,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
        assert line == (
            f"raykv in namespace {namespace!r} runs tiers this config leaves out: fs {tmp_path / 'a'}; they keep "
            "running (to stop them: `raykv stop`, then `raykv start`)"
        )
        # Both run, and the namespace's config now lists both (what `add_rule` checks a tier against).
        assert sorted(t["root"] for t in services.config.tiers) == [str(tmp_path / "a"), str(tmp_path / "b")]
        held = ray.get(services.control.config.remote())
        assert sorted(t["root"] for t in held.tiers) == sorted(t["root"] for t in services.config.tiers)
        caplog.clear()
        with caplog.at_level("WARNING", logger="raykv.services.cluster"):
            raykv.start({"namespace": namespace, "tiers": [second, first]})
        assert not [r for r in caplog.records if "leaves out" in r.getMessage()]
    finally:
        raykv.stop(namespace)


def _incarnation(control) -> str | None:
    """The control actor's incarnation (new at each restart); None while it restarts."""
    try:
        return ray.get(control.wait_rules.remote(-1, 0.0), timeout=10).incarnation
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_tiers_a_later_start_added_survive_a_control_actor_crash(ray_local, tmp_path) -> None:
    """Ray restarts a crashed control actor with its first config: the tiers a later start
    added come back from the GCS (the config ``raykv attach`` and ``raykv status`` see), and a
    stopped raykv forgets them."""
    namespace = "raykv-start-added-crash"
    first, second = _fs(tmp_path / "a"), _fs(tmp_path / "b")
    raykv.start({"namespace": namespace})
    try:
        control = raykv.start({"namespace": namespace, "tiers": [first, second]}).control
        before = _incarnation(control)
        ray.kill(control, no_restart=False)
        wait_until(
            lambda: _incarnation(control) not in (None, before), timeout_s=30, what="the control actor's restart"
        )
        held = ray.get(control.config.remote())  # what another process's `raykv attach` gets
        assert [t["root"] for t in held.tiers] == [first["root"], second["root"]]
    finally:
        raykv.stop(namespace)
    services = raykv.start({"namespace": namespace})
    try:
        assert services.config.tiers == [] and ray.get(services.control.config.remote()).tiers == []
    finally:
        raykv.stop(namespace)


def _config_file(tmp_path: Path, namespace: str, root: Path) -> str:
    """A config file of one fs tier at ``root``, for a ``raykv start`` in another process."""
    path = tmp_path / f"{namespace}.json"
    path.write_text(json.dumps({"namespace": namespace, "tiers": [_fs(root)]}))
    return str(path)


def _holder_types(namespace: str) -> list[str]:
    control = find_actor(naming.CONTROL_ACTOR, namespace)
    return [] if control is None else sorted(h.tier_type for h in ray.get(control.holders.remote()))


def test_a_failed_first_start_keeps_running_what_another_start_joined(ray_local, tmp_path, monkeypatch, caplog) -> None:
    """Two starts race in a new namespace: the first creates the services, the other joins
    them and starts its fs tier, then the first one's tier fails. The first start stops
    nothing: the other start's services keep running."""
    namespace = "raykv-start-fails-joined"
    other = _config_file(tmp_path, namespace, tmp_path / "other")
    address = ray.get_runtime_context().gcs_address
    start_tier = cluster.RaykvServices.start_tier_services

    def another_start_joins_first(self, tier_config, where="tier"):
        joined = run_raykv("start", "--config", other, address=address)
        assert joined.returncode == 0, joined.stderr
        return start_tier(self, tier_config, where)

    monkeypatch.setattr(cluster.RaykvServices, "start_tier_services", another_start_joins_first)
    try:
        with caplog.at_level("WARNING", logger="raykv.services.joining"):
            with pytest.raises(RaykvError, match="the root actor did not start"):
                raykv.start({"namespace": namespace, "tiers": [_fs(_unmounted(tmp_path))]})
        monkeypatch.undo()
        assert f"another start joined namespace {namespace!r} meanwhile: its services keep running" in caplog.text
        time.sleep(2.0)  # nothing is being stopped behind the error
        control = find_actor(naming.CONTROL_ACTOR, namespace)
        assert control is not None
        assert [t["root"] for t in ray.get(control.config.remote()).tiers] == [str(tmp_path / "other")]
        wait_until(lambda: _holder_types(namespace) == ["fs"], timeout_s=30, what="the other start's fs tier")
    finally:
        raykv.stop(namespace)


def test_a_start_joining_while_a_failed_first_start_stops_starts_raykv_again(ray_local, tmp_path, monkeypatch) -> None:
    """Another start that comes while a failed first start stops the services waits for the
    stop to end, then starts raykv afresh with its own tier: nothing of it is stopped."""
    namespace = "raykv-start-fails-then-another"
    other = _config_file(tmp_path, namespace, tmp_path / "other")
    address = ray.get_runtime_context().gcs_address
    stop_after_failed_start = cluster._stop_after_failed_start
    seen = {}

    def stop_once_the_other_start_waits(services):
        seen["control"] = services.control
        seen["other"] = spawn_raykv("start", "--config", other, address=address)
        wait_until(
            lambda: ray.get(services.control.stats.remote()).calls.get("join", 0) >= 2,
            timeout_s=60,
            what="the other start to join and be told that raykv is being stopped",
        )
        time.sleep(1.0)  # it waits: nothing of it starts before this stop
        stop_after_failed_start(services)

    monkeypatch.setattr(cluster, "_stop_after_failed_start", stop_once_the_other_start_waits)
    try:
        with pytest.raises(RaykvError, match="the root actor did not start"):
            raykv.start({"namespace": namespace, "tiers": [_fs(_unmounted(tmp_path))]})
        monkeypatch.undo()
        _, err = seen["other"].communicate(timeout=120)
        assert seen["other"].returncode == 0, err
        assert "failed and stops what it started: starting again after it" in err
        control = find_actor(naming.CONTROL_ACTOR, namespace)
        assert control is not None and control != seen["control"]  # a new raykv, the other start's
        assert [t["root"] for t in ray.get(control.config.remote()).tiers] == [str(tmp_path / "other")]
        wait_until(lambda: _holder_types(namespace) == ["fs"], timeout_s=30, what="the other start's fs tier")
        assert stopping_until(namespace) is None
    finally:
        if "other" in seen and seen["other"].poll() is None:
            seen["other"].kill()
        raykv.stop(namespace)


def test_the_control_actor_lets_only_a_lone_first_start_stop_it(ray_local) -> None:
    """``join`` and ``close_if_alone``: only the start that created the actor is FIRST, it
    may stop raykv only when no other start joined, and starts joining then are told CLOSING."""
    namespace = "raykv-start-join-roles"
    config = raykv.RaykvConfig(namespace=namespace)
    joined = ControlActor.options(namespace=namespace).remote(config, "first")
    try:
        assert ray.get(joined.join.remote("first")) is StartRole.FIRST
        assert ray.get(joined.join.remote("second")) is StartRole.JOINED
        assert ray.get(joined.close_if_alone.remote("first")) is False
        assert stopping_until(namespace) is None
    finally:
        ray.kill(joined)
    alone = ControlActor.options(namespace=namespace).remote(config, "first")
    try:
        assert ray.get(alone.join.remote("first")) is StartRole.FIRST
        assert ray.get(alone.close_if_alone.remote("second")) is False  # not the first start
        assert ray.get(alone.close_if_alone.remote("first")) is True
        assert ray.get(alone.join.remote("third")) is StartRole.CLOSING
        until = stopping_until(namespace)
        assert until is not None and time.time() < until <= time.time() + 60
    finally:
        ray.kill(alone)
        clear_stopping(namespace)
