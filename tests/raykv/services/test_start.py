"""``raykv start`` / ``raykv.start``: a start that fails leaves the namespace as it found
it, and starting again names what the new config leaves out (on a real local Ray)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.errors import RaykvError
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
