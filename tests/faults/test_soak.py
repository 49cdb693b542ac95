"""Soak: a bounded randomized run of store / load / evict / kill on a real
local Ray, checking every invariant after every step.

The short run (~25 s) is marked ``long`` (``make test-long``, which CI runs);
``--soak`` adds the long one (at most 5 minutes). The seed is printed so a failure can be replayed
(``RAYKV_SOAK_SEED``).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import pytest
import ray

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import raykv  # noqa: E402
from raykv.core import naming  # noqa: E402
from raykv.core.factory import TierFactory  # noqa: E402
from raykv.engine.primary import PrimaryRegion  # noqa: E402

NS = "raykv-soak"
MiB = 1 << 20


@pytest.fixture(scope="module")
def soak_services(ray_local):
    services = raykv.start({"namespace": NS, "directory_shards": 2})
    yield services
    services.shutdown()


def _kill(services, root: str, what: str) -> str:
    node = ray.get_runtime_context().get_node_id()
    if what == "kill_object_store":
        actor = ray.get_actor(naming.object_store_actor(node), namespace=NS)
    elif what == "kill_fs_root":
        actor = ray.get_actor(naming.fs_actor(root), namespace=NS)
    else:
        actor = random.choice(services.directory.shards)
    ray.kill(actor, no_restart=False)  # a crash: Ray restarts it
    return what


def soak(services, tmp_path, seconds: float) -> dict:
    seed = int(os.environ.get("RAYKV_SOAK_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    print(f"\nsoak seed {seed} ({seconds:.0f} s)")
    root = str(tmp_path / "kv")
    region = PrimaryRegion(32, harness.BLOCK)
    tiers = {
        "object_store": TierFactory.create_tier(
            {"type": "object_store", "namespace": NS, "capacity_bytes": 2 * MiB, "job_timeout_s": 20.0},
            region.view,
            services=services,
        ),
        "fs": TierFactory.create_tier(
            {
                "type": "fs",
                "namespace": NS,
                "root": root,
                "capacity_bytes": 3 * MiB,
                "fsync": False,
                "control_timeout_s": 10.0,
            },
            region.view,
            services=services,
        ),
    }
    fs_actor = tiers["fs"].actor
    ops: dict[str, int] = {}
    end = time.monotonic() + seconds
    step = 0
    try:
        while time.monotonic() < end:
            step += 1
            work = harness.Workload(tiers, region.array, keyspace=rng.choice([8, 24, 64]), seed=rng.randrange(10**6))
            op = rng.choice(["work", "kill_object_store", "kill_fs_root", "kill_shard", "resize_fs"])
            span = rng.uniform(0.5, 2.0)
            runner = threading.Thread(target=lambda: work.run(span, drain_s=60.0))
            runner.start()
            time.sleep(rng.uniform(0.0, span))  # not a wait: the fault lands at a random point of the work
            if op.startswith("kill"):
                _kill(services, root, op)
            elif op == "resize_fs":
                ray.get(fs_actor.set_capacity.remote(rng.choice([1, 2, 3]) * MiB), timeout=30)
            runner.join(120)
            assert not runner.is_alive(), f"step {step} ({op}): the workload hung"
            rep = work.report()
            try:
                harness.assert_clean(rep)
            except AssertionError as e:
                raise AssertionError(f"seed {seed} step {step} ({op}): {e}") from None
            problems = harness.wait_invariants(services, timeout=15)
            assert not problems, f"seed {seed} step {step} ({op}): {problems}"
            ops[op] = ops.get(op, 0) + 1
    finally:
        for t in tiers.values():
            t.shutdown()
        region.close()
    print(f"soak: {step} steps, ops {ops}")
    return ops


@pytest.mark.long
def test_soak_short(soak_services, tmp_path):
    ops = soak(soak_services, tmp_path, float(os.environ.get("RAYKV_SOAK_SHORT_S", 25)))
    assert sum(ops.values()) >= 4


@pytest.mark.soak
@pytest.mark.timeout(330)
def test_soak_long(soak_services, tmp_path):
    ops = soak(soak_services, tmp_path, float(os.environ.get("RAYKV_SOAK_S", 240)))
    assert sum(ops.values()) >= 20
