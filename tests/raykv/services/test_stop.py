"""``raykv stop`` / ``raykv.stop``: every raykv actor of the namespace goes; a namespace
where raykv does not run is not an error; a half-stopped raykv's actors go too."""

from __future__ import annotations

import ray

import raykv
from raykv.core import naming
from raykv.ops.cli import main
from raykv.services.rules_store import load_rules
from tests.waiting import wait_until


def _raykv_actors(namespace: str) -> set[str]:
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith("raykv-")
    }


def test_stop_where_nothing_runs_says_so_and_exits_0(ray_local, capsys) -> None:
    code = main(["stop", "--namespace", "raykv-never-started", "--address", ray.get_runtime_context().gcs_address])
    out = capsys.readouterr().out
    assert code == 0
    assert "raykv was not running in Ray namespace 'raykv-never-started'" in out, out
    assert "shared-memory segments" in out, out  # the node cleanup still ran


def test_stop_kills_every_actor_of_a_running_raykv(ray_local) -> None:
    namespace = "raykv-stop-running"
    config = {"namespace": namespace, "directory_shards": 2, "tiers": [{"type": "object_store"}]}
    services = raykv.start(config)
    started = _raykv_actors(namespace)
    node = ray.get_runtime_context().get_node_id()
    assert {naming.CONTROL_ACTOR, naming.directory_shard(1), naming.object_store_actor(node)} <= started, started
    version = services.add_rule({"name": "run-time", "tier": "*", "policy": "REQUEST_LEVEL"})
    assert load_rules(namespace) is not None and load_rules(namespace).version == version  # kept for a crash
    stopped = raykv.stop(namespace)
    assert stopped.was_running and stopped.leftovers == ()
    wait_until(lambda: not _raykv_actors(namespace), timeout_s=20.0, what="raykv's actors to go")
    # A stopped raykv forgets its run-time rules: the next start has its config's.
    assert load_rules(namespace) is None
    again = raykv.start(config)
    assert ray.get(again.control.rules.remote()) == (0, [])
    raykv.stop(namespace)


def test_stop_after_the_control_actor_died_kills_what_is_left(ray_local) -> None:
    namespace = "raykv-stop-half"
    raykv.start({"namespace": namespace, "directory_shards": 2, "tiers": [{"type": "object_store"}]})
    control = ray.get_actor(naming.CONTROL_ACTOR, namespace=namespace)
    ray.kill(control, no_restart=True)
    wait_until(lambda: naming.CONTROL_ACTOR not in _raykv_actors(namespace), timeout_s=20.0, what="control gone")
    left = _raykv_actors(namespace)
    assert naming.directory_shard(0) in left, left
    stopped = raykv.stop(namespace)
    assert not stopped.was_running
    assert set(stopped.leftovers) == left
    wait_until(lambda: not _raykv_actors(namespace), timeout_s=20.0, what="the leftover actors to go")


def test_an_engine_that_finds_no_raykv_starts_one_and_says_so(ray_local, caplog) -> None:
    """What an engine's tier does (``attach(start_if_missing=True)``): a raykv with the default
    settings, and a warning naming the namespace (a mistyped one shows in the engine's log)."""
    import logging

    from raykv.services.cluster import attach

    namespace = "raykv-started-by-an-engine"
    with caplog.at_level(logging.WARNING, logger="raykv.services.cluster"):
        services = attach(namespace, start_if_missing=True)
    assert naming.CONTROL_ACTOR in _raykv_actors(namespace)
    assert any(
        f"raykv was not running in Ray namespace {namespace!r}: started it" in r.getMessage() for r in caplog.records
    ), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raykv.services.cluster"):
        assert attach(namespace, start_if_missing=True) is services  # running now: no second word
    assert not caplog.records
    raykv.stop(namespace)


def test_the_process_that_stops_raykv_is_not_warned_that_raykv_is_gone(ray_local, caplog) -> None:
    """The stopping process's own policy cache (its long poll of the control actor)
    stops first: it does not warn, as an engine's does, that the control actor is gone."""
    namespace = "raykv-stop-quiet"
    services = raykv.start({"namespace": namespace, "directory_shards": 1})
    services.add_rule({"name": "r", "tier": "*", "policy": "REQUEST_LEVEL"})
    cache = services.policy
    wait_until(lambda: cache.version >= 1, timeout_s=20.0, what="the policy cache's first answer")
    with caplog.at_level("WARNING"):
        services.shutdown()
        wait_until(lambda: not _raykv_actors(namespace), timeout_s=20.0, what="raykv's actors to go")
    assert not cache.control_gone
    assert not [r for r in caplog.records if "control actor is gone" in r.getMessage()], caplog.text
