"""raykv's Ray metrics: local accounting, and a real scrape of a node's metrics port after traffic."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import ray

import raykv
from raykv import metrics
from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.factory import TierFactory
from raykv.core.jobs import MeteredJobTracker
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from raykv.metrics import recorders, scrape
from tests.clusters import start_local_ray
from tests.waiting import WaitTimeout, wait_until

BLOCK = 64 * 1024
NS = "raykv-metrics-test"


def _job(job_id: int, n: int, load: bool) -> TransferJob:
    keys = [bytes([i]) * 8 for i in range(n)]
    return TransferJob(job_id, keys, np.arange(n), load, ReqContext("r"))


def test_metered_job_tracker_accounts_every_result() -> None:
    tm = recorders.TierMetrics("object_store", "node-a")
    jobs = MeteredJobTracker(tm, block_bytes=BLOCK)
    store, load, bad = _job(1, 3, False), _job(2, 4, True), _job(3, 2, True)
    for j in (store, load, bad):
        jobs.begin(j)
    assert jobs.succeed(store, transfer_bytes=3 * BLOCK)
    assert jobs.fail(load, "two missing", successful_keys=list(load.keys)[:2])
    assert jobs.succeed(bad)
    assert not jobs.succeed(bad)  # a second result is dropped, and not counted
    for r in (LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY):
        tm.lookup(r)
    assert len(jobs.take()) == 3
    tm.flush()
    tm.flush()  # nothing new: no double counting
    assert tm.totals == {
        "raykv_blocks_stored": 3,
        "raykv_bytes_stored": 3 * BLOCK,
        "raykv_blocks_loaded": 2 + 2,
        "raykv_bytes_loaded": 4 * BLOCK,
        "raykv_lookups": 3,
        "raykv_lookup_hits": 2,
        "raykv_lookup_misses": 1,
        "raykv_lookup_retries": 1,
        "raykv_jobs_finished": 3,
        "raykv_jobs_failed": 1,
    }


def test_undeclared_metric_is_refused() -> None:
    with pytest.raises(KeyError):
        metrics.metric("raykv_not_in_the_catalog")


@pytest.fixture(scope="module")
def metrics_ray(tmp_path_factory):
    """A local Ray that exports metrics every 0.5 s (the default waits ~10 s)."""
    start_local_ray(
        num_cpus=2,
        object_store_memory=256 * 1024 * 1024,
        _system_config={"metrics_report_interval_ms": 500},
    )
    root = tmp_path_factory.mktemp("fs-root")
    services = raykv.start({"namespace": NS, "directory_shards": 2})
    yield services, str(root)
    services.shutdown()
    ray.shutdown()


def _traffic(services, root: str) -> dict[str, dict[str, int]]:
    """Stores, hits, misses, a failed load and evictions through the object_store and fs tiers."""
    region = PrimaryRegion(64, BLOCK)
    region.array[:] = np.random.default_rng(0).integers(0, 256, region.array.shape, dtype=np.uint8)
    totals = {}
    try:
        configs = {
            "object_store": {"type": "object_store", "capacity_bytes": 24 * BLOCK},
            "fs": {"type": "fs", "root": root, "capacity_bytes": 24 * (BLOCK + 1024), "fsync": False},
        }
        for name, cfg in configs.items():
            tier = TierFactory.create_tier(cfg, region.view, services=services)
            drv = TierDriver(tier)
            keys = prefix_keys(list(range(16 * 40)), 16, salt=name)  # 40 blocks
            assert drv.store(keys[:16], list(range(16))).success
            assert drv.lookup(keys[:20]) == [LookupResult.HIT] * 16 + [LookupResult.MISS] * 4
            assert drv.load(keys[:8], list(range(32, 40))).success
            assert np.array_equal(region.array[32:40], region.array[:8])
            assert not drv.load(keys[30:32], [40, 41]).success  # never stored: a failed job
            assert drv.store(keys[16:40], list(range(16, 40))).success  # over capacity: evictions
            tier.on_schedule_end()
            totals[name] = dict(tier.metrics.totals)
            tier.shutdown()
    finally:
        region.close()
    return totals


def _scrape_until(want, timeout: float = 30.0):
    """(series, missing): the cluster's series once ``want(series)`` finds nothing
    missing, or, after ``timeout``, the last scrape and what it still misses."""
    series: list = []
    missing: list = []

    def complete() -> bool:
        nonlocal series, missing
        series = scrape.scrape_cluster()
        missing = want(series)
        return not missing

    with contextlib.suppress(WaitTimeout):  # the callers assert on what is missing
        wait_until(complete, timeout_s=timeout, interval_s=0.5, what="every wanted series in the scrape")
    return series, missing


def test_metrics_endpoint_shows_raykv_metrics_after_traffic(metrics_ray) -> None:
    services, root = metrics_ray
    totals = _traffic(services, root)
    for tier in ("object_store", "fs"):  # the driver re-asks until no key is RETRY: at least once each
        assert totals[tier]["raykv_lookup_hits"] >= 16 and totals[tier]["raykv_lookup_misses"] >= 4
        assert totals[tier]["raykv_jobs_failed"] == 1 and totals[tier]["raykv_blocks_stored"] == 40
    node = ray.nodes()[0]
    assert node["MetricsExportPort"]

    nonzero_by_tier = [
        "ray_raykv_lookups_total",
        "ray_raykv_lookup_hits_total",
        "ray_raykv_lookup_misses_total",
        "ray_raykv_blocks_stored_total",
        "ray_raykv_blocks_loaded_total",
        "ray_raykv_bytes_stored_total",
        "ray_raykv_bytes_loaded_total",
        "ray_raykv_jobs_finished_total",
        "ray_raykv_jobs_failed_total",
        "ray_raykv_job_latency_seconds_count",
        "ray_raykv_tier_blocks",
        "ray_raykv_tier_bytes",
        "ray_raykv_tier_capacity_bytes",
        "ray_raykv_tier_stored_blocks_total",
        "ray_raykv_tier_evicted_blocks_total",
    ]
    nonzero = [
        "ray_raykv_directory_keys",
        "ray_raykv_directory_lookup_keys_total",
        "ray_raykv_directory_invalidations_total",
    ]

    def missing(series) -> list[str]:
        out = []
        for name in nonzero_by_tier:
            by_tier = scrape.sum_series(series, name, "tier")
            out += [f"{name}{{tier={t}}}" for t in ("object_store", "fs") if not by_tier.get(t)]
        out += [n for n in nonzero if not sum(scrape.sum_series(series, n, "shard").values())]
        # The engine-side counters of this node equal what the tiers counted (the
        # process may also export series of other node tags, e.g. the unit test above).
        for tier in ("object_store", "fs"):
            here = [s for s in series if s[1].get("tier") == tier and s[1].get("node") == node["NodeID"]]
            for name, value in totals[tier].items():
                got = scrape.sum_series(here, f"ray_{name}_total", "tier").get(tier, 0)
                if got != value:
                    out.append(f"ray_{name}_total{{tier={tier}, node=this}}={got} != {value}")
        return out

    series, left = _scrape_until(missing)
    assert not left, left
    # Occupancy per tier and node: the object store tier is at its capacity after evictions.
    used = scrape.sum_series([s for s in series if s[1].get("tier") == "object_store"], "ray_raykv_tier_bytes", "node")
    cap = scrape.sum_series(
        [s for s in series if s[1].get("tier") == "object_store"], "ray_raykv_tier_capacity_bytes", "node"
    )
    assert list(used) == [node["NodeID"]] and 0 < used[node["NodeID"]] <= cap[node["NodeID"]] == 24 * BLOCK
    reasons = scrape.sum_series(series, "ray_raykv_directory_invalidations_total", "reason")
    assert reasons.get("evicted", 0) > 0


def test_engine_step_and_request_costs_reach_the_metrics_port(metrics_ray) -> None:
    """raykv's time per engine step, its polls and the RETRYs per request
    (``raykv.metrics.step_cost``) are exported as Ray metrics of the engine's node."""
    services, _ = metrics_ray
    with PrimaryRegion(16, BLOCK) as region:
        tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
        try:
            drv = TierDriver(tier)
            keys = prefix_keys(list(range(50_000, 50_000 + 6 * 16)), 16)
            assert drv.store(keys[:3], [0, 1, 2]).success
            assert drv.lookup(keys) == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
        finally:
            tier.shutdown()
    node = ray.get_runtime_context().get_node_id()
    wanted = (
        "ray_raykv_engine_steps_total",
        "ray_raykv_engine_tier_seconds_total",
        "ray_raykv_engine_polls_total",
        "ray_raykv_engine_step_seconds_count",
        "ray_raykv_request_retries_count",
    )

    def missing(series) -> list[str]:
        return [n for n in wanted if not scrape.sum_series(series, n, "node").get(node)]

    series, left = _scrape_until(missing)
    assert not left, left
    steps = scrape.sum_series(series, "ray_raykv_engine_steps_total", "node")[node]
    seconds = scrape.sum_series(series, "ray_raykv_engine_tier_seconds_total", "node")[node]
    assert 0 < seconds / steps < 1.0, (seconds, steps)
