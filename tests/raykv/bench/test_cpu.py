"""raykv.bench.cpu: CPU seconds by process role, on real processes (this one and a Ray actor)."""

from __future__ import annotations

import time

import pytest
import ray

from raykv.bench.cpu import cpu_by_role, cpu_delta, cpu_per_request


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@ray.remote
class Burner:
    def burn(self, seconds: float) -> int:
        _burn(seconds)
        return 1


def test_an_actor_and_this_process_are_counted_by_role(ray_local) -> None:
    actor = Burner.remote()
    ray.get(actor.burn.remote(0.0))  # started, before the first snapshot
    before = cpu_by_role()
    ray.get(actor.burn.remote(0.4))
    _burn(0.3)
    spent = cpu_delta(before, cpu_by_role())
    assert spent.get("Burner", 0.0) >= 0.35, spent
    assert spent.get("other", 0.0) >= 0.25, spent  # pytest itself
    assert list(spent.values()) == sorted(spent.values(), reverse=True)


def test_a_process_that_ended_is_not_counted_and_a_new_one_counts_from_zero() -> None:
    before = {1_000_000_001: ("gone", 5.0), 1_000_000_002: ("kept", 1.0)}
    after = {1_000_000_002: ("kept", 3.5), 1_000_000_003: ("new", 0.5)}
    assert cpu_delta(before, after) == {"kept": 2.5, "new": 0.5}


def test_cpu_per_request_groups_raykv_roles() -> None:
    spent = {
        "ObjectStoreActor": 2.0,
        "FsRootActor": 1.0,
        "DirectoryShard": 0.5,
        "ControlActor": 0.1,
        "ServeReplica:app:LLMServer": 4.0,
        "vLLM EngineCore": 2.0,
        "ServeReplica:app:OpenAiIngress": 0.4,
        "raylet": 3.0,
        "other": 9.0,
    }
    per = cpu_per_request(spent, 10)
    assert per == pytest.approx(
        {
            "engines": 0.6,
            "holder actors": 0.3,
            "directory shards": 0.05,
            "router (Serve ingress)": 0.04,
            "control": 0.01,
        }
    ), per
    assert list(per) == ["engines", "holder actors", "directory shards", "router (Serve ingress)", "control"]
    with pytest.raises(ValueError, match="requests"):
        cpu_per_request(spent, 0)
