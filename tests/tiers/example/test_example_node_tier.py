"""The cluster-wide example tier on a real local Ray: what the bases give a
tier that writes only its storage (directory, placement, jobs, holder death)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import raykv
from raykv.core.contract import LookupResult
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.waiting import wait_until

NS = "raykv-example-node-test"
BLOCK = 8192


@pytest.fixture(scope="module")
def services(ray_local):
    s = raykv.start({"namespace": NS, "directory_shards": 2})
    yield s
    s.shutdown()


def _wait_name_free(name: str, timeout: float = 10.0) -> None:
    """Until the GCS has the killed actor ``name`` dead (its name free again)."""

    def name_free() -> bool:
        try:
            ray.get_actor(name, namespace=NS)
        except ValueError:
            return True
        return False

    wait_until(name_free, timeout_s=timeout, interval_s=0.05, what=f"actor {name} to be unregistered")


def _tier(services, region, **options):
    return TierFactory.create_tier({"type": "example_node", **options}, region.view, services=services)


def test_one_engine_loads_what_another_stored(services):
    keys = prefix_keys(list(range(60)), 10)
    with PrimaryRegion(8, BLOCK) as a, PrimaryRegion(8, BLOCK) as b:
        a.array[:] = np.random.default_rng(1).integers(0, 256, a.array.shape, dtype=np.uint8)
        writer, reader = _tier(services, a), _tier(services, b)
        try:
            assert TierDriver(writer).store(keys[:4], [0, 1, 2, 3]).success
            assert reader.lookup_blocking(keys[:6]) == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 2
            res = TierDriver(reader).load(keys[:4], [7, 6, 5, 4])
            assert res.success, res.error
            for s, d in zip([0, 1, 2, 3], [7, 6, 5, 4]):
                assert np.array_equal(a.array[s], b.array[d])
            # a key it lost is a failed key, not a failed engine
            res = TierDriver(reader).load([keys[0], keys[5]], [0, 1])
            assert not res.success and list(res.successful_keys) == [keys[0]]
            assert ray.get(writer.actor.stats.remote()).figures["blocks"] == 4
        finally:
            writer.shutdown()
            reader.shutdown()


def test_capacity_evicts_least_recently_used_and_unregisters(services):
    keys = prefix_keys(list(range(1000, 1060)), 10)
    with PrimaryRegion(6, BLOCK) as region:
        old = _tier(services, region)
        ray.kill(old.actor, no_restart=True)  # start this node's actor afresh, with room for 3 blocks
        old.shutdown()
        _wait_name_free(old.holder_info.actor_name)
        tier = _tier(services, region, capacity_bytes=3 * BLOCK)
        try:
            for i in range(6):
                assert TierDriver(tier).store([keys[i]], [i]).success
            stats = ray.get(tier.actor.stats.remote()).figures
            assert (stats["blocks"], stats["bytes"], stats["evicted"]) == (3, 3 * BLOCK, 3)
            held = [bool(h) for h in services.directory.lookup([tier.scope(k) for k in keys[:6]])]
            assert held == [False] * 3 + [True] * 3, "evicted blocks must leave the directory"
            # another engine asking for more keeps the running actor's capacity
            other = _tier(services, region, capacity_bytes=100 * BLOCK)
            other.shutdown()
            assert ray.get(tier.actor.stats.remote()).figures["capacity_bytes"] == 3 * BLOCK
        finally:
            tier.shutdown()


def test_a_dead_holder_leaves_the_directory_and_lookups_miss(services):
    keys = prefix_keys(list(range(2000, 2030)), 10)  # 3 blocks: within any capacity the actor runs with
    with PrimaryRegion(4, BLOCK) as region:
        tier = _tier(services, region)
        try:
            assert TierDriver(tier).store(keys, [0, 1, 2]).success
            assert [bool(h) for h in services.directory.lookup([tier.scope(k) for k in keys])] == [True] * 3
            ray.kill(tier.actor, no_restart=True)
            wait_until(
                lambda: not any(services.directory.lookup([tier.scope(k) for k in keys])),
                timeout_s=10,
                interval_s=0.05,
                what="the dead holder's entries to leave the directory",
            )
            services.lookup_cache.invalidate([tier.scope(k) for k in keys])
            assert tier.lookup_blocking(keys) == [LookupResult.MISS] * 3
            res = TierDriver(tier).load(keys[:1], [0])  # a job still ends in a result
            assert not res.success
        finally:
            tier.shutdown()


@ray.remote
def _late_load_answer(delay_s: float):  # a holder whose copy is still running when the job times out
    import time

    from raykv.core.wire import LoadAnswer

    time.sleep(delay_s)
    return LoadAnswer(ok=(0,), errors={}, bytes=BLOCK)


def test_a_timed_out_load_holds_its_chunks_until_the_call_ends(services, monkeypatch):
    """vLLM 0.34+ keeps a failed load's chunks out of use until ``deferred_release`` is set:
    raykv sets it when the actor's call ends, not when the job times out."""
    from raykv.core.contract import ReqContext, TransferJob

    keys = prefix_keys(list(range(2000, 2020)), 10)
    with PrimaryRegion(4, BLOCK) as region:
        tier = _tier(services, region, job_timeout_s=0.2)
        monkeypatch.setattr(tier, "HOLD_AFTER_TIMEOUT_S", 60.0)  # the 30 s call below outlives no bound
        try:
            ray.get(_late_load_answer.remote(0.0))  # a worker for the task is up: the test times no start-up
            job = TransferJob(1, [keys[0]], np.array([0]), True, ReqContext("late"))
            sent = time.monotonic()
            tier.send_job("load", job, lambda _keys, _chunks: _late_load_answer.remote(3.0))
            results = wait_until(tier.get_finished_jobs, timeout_s=10, interval_s=0.02, what="the job to time out")
            (result,) = results
            assert not result.success and "timed out" in (result.error or "")
            release = result.deferred_release
            assert release is not None and not release.is_set() and tier.has_pending_work()
            wait_until(lambda: tier.get_finished_jobs() == [] and release.is_set(), timeout_s=15, what="the release")
            assert time.monotonic() - sent >= 3.0  # held until the call answered, not released at the timeout
            assert not tier.has_pending_work()
            # drain_jobs (vLLM's reset_cache) returns only once the held releases are set
            job = TransferJob(3, [keys[1]], np.array([1]), True, ReqContext("late"))
            sent = time.monotonic()
            tier.send_job("load", job, lambda _keys, _chunks: _late_load_answer.remote(2.0))
            (result,) = wait_until(tier.get_finished_jobs, timeout_s=10, interval_s=0.02, what="the job to time out")
            assert result.deferred_release is not None and not result.deferred_release.is_set()
            tier.drain_jobs()
            assert result.deferred_release.is_set() and time.monotonic() - sent >= 2.0
            # a release still held at shutdown is set before shutdown returns
            job = TransferJob(2, [keys[1]], np.array([1]), True, ReqContext("late"))
            tier.send_job("load", job, lambda _keys, _chunks: _late_load_answer.remote(30.0))
            (result,) = wait_until(tier.get_finished_jobs, timeout_s=10, interval_s=0.02, what="the job to time out")
            assert result.deferred_release is not None and not result.deferred_release.is_set()
        finally:
            tier.shutdown()
        assert result.deferred_release.is_set()
