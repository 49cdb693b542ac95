"""The in-memory reference tier honours the contract."""

from __future__ import annotations

import numpy as np

from raykv.core.contract import LookupResult, OffloadPolicy, ReqContext
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.core.pins import Unpin
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver


def _tier(view, **options):
    return TierFactory.create_tier({"type": "example", **options}, view)


def test_store_lookup_load_roundtrip():
    rng = np.random.default_rng(0)
    with PrimaryRegion(8, 4096) as src:
        src.array[:] = rng.integers(0, 256, src.array.shape, dtype=np.uint8)
        tier = _tier(src.view)
        keys = prefix_keys(list(range(80)), 10)
        drv = TierDriver(tier)
        assert drv.store(keys[:4], [0, 1, 2, 3]).success
        assert drv.lookup(keys[:5]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
        stored = src.array[:4].copy()
        src.array[:] = 0  # the engine reused every slot
        assert drv.load(keys[:4], [7, 6, 5, 4]).success
        for s, d in zip([0, 1, 2, 3], [7, 6, 5, 4]):
            assert np.array_equal(stored[s], src.array[d])
        assert not src.array[:4].any(), "a load wrote outside its slots"
        tier.shutdown()


def test_partial_load_reports_successful_keys():
    with PrimaryRegion(4, 4096) as region:
        tier = _tier(region.view)
        keys = prefix_keys(list(range(40)), 10)
        drv = TierDriver(tier)
        assert drv.store(keys[:2], [0, 1]).success
        result = drv.load(keys[:3], [2, 3, 0])
        assert not result.success
        assert list(result.successful_keys) == keys[:2]
        assert result.error
        tier.shutdown()


def test_capacity_is_lru():
    with PrimaryRegion(4, 4096) as region:
        tier = _tier(region.view, capacity_blocks=2)
        keys = prefix_keys(list(range(40)), 10)
        drv = TierDriver(tier)
        drv.store(keys[:2], [0, 1])
        tier.touch([keys[0]], drv.req)
        drv.store(keys[2:3], [2])
        assert drv.lookup(keys[:3]) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        tier.shutdown()


def test_request_level_option():
    with PrimaryRegion(2, 4096) as region:
        tier = _tier(region.view, request_level=True)
        ctx = tier.on_new_request(ReqContext("r1"))
        assert ctx.policy is OffloadPolicy.REQUEST_LEVEL
        assert ctx.request_level_tiers == {"example"}
        tier.shutdown()


def test_jobs_after_shutdown_fail_instead_of_hanging():
    with PrimaryRegion(2, 4096) as region:
        tier = _tier(region.view)
        tier.shutdown()
        drv = TierDriver(tier)
        result = drv.store(prefix_keys(list(range(10)), 10), [0], timeout=5)
        assert not result.success and "shut down" in result.error
        assert list(tier.get_finished_jobs()) == []  # exactly one result, already taken


def test_pinned_blocks_outlive_lru_until_unpinned():
    with PrimaryRegion(8, 4096) as region:
        tier = _tier(region.view, capacity_blocks=4)  # max_pinned_fraction 0.5: 2 blocks
        keys = prefix_keys(list(range(400)), 10)
        drv, pin_drv = TierDriver(tier), TierDriver(tier, "pinned")
        pin_drv.req = ReqContext("pinned", {"cache_ttl_s": 60})
        assert pin_drv.store(keys[:2], [0, 1]).success
        assert drv.store(keys[2:4], [2, 3]).success  # the same age, unpinned
        for i in range(4, 16, 2):  # three times the capacity
            assert drv.store(keys[i : i + 2], [4, 5]).success
        assert drv.lookup(keys[:4]) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2
        assert pin_drv.store(keys[20:22], [6, 7]).success  # over the cap: stored, not pinned
        assert tier.lru.pin_report()["pinned_blocks"] == 2
        assert tier.unpin(Unpin(everything=True)) == 2
        assert drv.store(keys[30:34], [0, 1, 2, 3]).success
        assert drv.lookup(keys[:2]) == [LookupResult.MISS] * 2  # plain LRU again
        tier.shutdown()
