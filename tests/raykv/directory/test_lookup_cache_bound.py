"""An engine's directory answers stay within ``lookup_cache_entries`` (issue 14, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

import raykv
from raykv.core.contract import LookupResult, ReqContext
from raykv.core.factory import TierFactory
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver

CAP = 20_000
DISTINCT = 1_000_000
STEP = 2_000  # lookups per simulated engine step


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture
def bounded(ray_local):
    # Views of asked keys only: every distinct key is a question whose answer the engine keeps
    # (a complete view, the default, answers them from /dev/shm and the engine keeps nothing).
    services = raykv.start(
        {"namespace": "raykv-bounded", "directory_shards": 2, "lookup_cache_entries": CAP, "agent_view_all_keys": False}
    )
    region = PrimaryRegion(64, 4096)
    tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
    yield services, tier
    tier.shutdown()
    region.close()
    services.shutdown()


@pytest.mark.long  # 20-25 s on a 2-core host
def test_a_million_distinct_lookups_keep_the_cache_within_its_cap(bounded):
    services, tier = bounded
    cache = services.lookup_cache
    assert cache.max_entries == CAP
    rng = np.random.default_rng(14)
    held = [bytes(k) for k in rng.integers(0, 256, (64, 44), dtype=np.uint8)]
    assert TierDriver(tier).store(held, list(range(64))).success

    ctx = ReqContext("bounded")
    start_rss = _rss_mib()
    peak = {"answers": 0, "queued": 0, "in_flight": 0, "pending": 0}
    answered = {r: 0 for r in LookupResult}
    done = 0
    while done < DISTINCT:
        keys = [bytes(k) for k in rng.integers(0, 256, (STEP, 44), dtype=np.uint8)]
        if done % 100_000 == 0:
            keys[:8] = held[(done // 100_000) % 8 * 8 :][:8]
        for k in keys:
            answered[tier.lookup(k, ctx)] += 1
        tier.on_schedule_end()  # the step's one batched directory call
        done += len(keys)
        for name, n in cache.sizes().items():
            peak[name] = max(peak[name], n)
        assert len(cache) <= CAP
    cache.wait(30)
    for k in held[:8]:  # answers for our own blocks still come back right
        tier.lookup(k, ctx)
    cache.wait(30)
    assert [tier.lookup(k, ctx) for k in held[:8]] == [LookupResult.HIT] * 8
    growth = _rss_mib() - start_rss
    print(
        f"\n{DISTINCT:,} distinct lookups, cap {CAP:,}: peak entries {peak}, evicted {cache.evicted:,}, "
        f"answers {dict((r.name, n) for r, n in answered.items())}, RSS growth {growth:.1f} MiB"
    )
    # Keys in flight are capped too (a slow directory: tests/faults/test_slow_directory.py); how
    # many steps' worth are in flight here depends on the host's round trip (2-3 steps on CI).
    assert peak["answers"] <= CAP and peak["queued"] <= CAP and peak["in_flight"] <= CAP
    assert cache.evicted >= DISTINCT - CAP - 2 * STEP
    assert growth < 256, f"engine memory grew {growth:.0f} MiB over 1M lookups"
