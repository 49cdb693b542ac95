"""A full Ray object store on a real local Ray: the store job ends in one failed
result naming the cause, nothing is registered or half-stored, lookups miss;
once plasma has room again the same tier stores and loads byte-identical blocks.

Ray 2.60 spills, then falls back to disk-backed allocation, before it refuses a
put; it refuses with ``OutOfDiskError`` ("the local object store is full and the
local disk's utilization is over capacity") once the disk is over
``local_fs_capacity_threshold``. A threshold of 0 makes every disk "full", and
with automatic spilling off plasma cannot make room by spilling the driver's
ballast to disk either (spilling ran fast enough on one CI machine to take 192 MiB
of ballast into a 96 MiB store), so the refusal comes as soon as plasma is full
(``ObjectStoreFullError``, its older form, is accepted too)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import raykv
from raykv.core.contract import LookupResult
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.clusters import start_local_ray
from tests.waiting import WaitTimeout, wait_until

MiB = 1024 * 1024
BLOCK = MiB
PLASMA = 96 * MiB
STORE_FULL = (ray.exceptions.ObjectStoreFullError, ray.exceptions.OutOfDiskError)


@pytest.fixture(scope="module")
def services_no_spill():
    start_local_ray(
        num_cpus=2,
        object_store_memory=PLASMA,
        _system_config={"local_fs_capacity_threshold": 0.0, "automatic_object_spilling_enabled": False},
    )
    services = raykv.start({"namespace": "raykv-full", "directory_shards": 1})
    yield services
    services.shutdown()
    ray.shutdown()


def _fill_plasma() -> list:
    """Objects the driver holds until plasma refuses more.

    It fills with 8 MiB objects, then 1 MiB, then 128 KiB ones, so that what is
    left is smaller than one block: filling with 8 MiB objects alone could leave
    up to 8 MiB free, room for the whole store this test expects to fail. Then,
    after a pause, it fills again: objects other processes held for a moment
    (actor calls' large arguments and returns live in plasma too) may have been
    freed meanwhile, and their room would take the store."""
    ballast = []
    for round_ in range(2):
        if round_:
            time.sleep(1.0)
        for size in (8 * MiB, MiB, MiB // 8):
            try:
                for _ in range(2 * PLASMA // size):
                    ballast.append(ray.put(np.ones(size, np.uint8)))
            except STORE_FULL:
                continue
            pytest.fail(f"plasma took {2 * PLASMA} bytes of {size}-byte objects without refusing")
    return ballast


def test_full_object_store_fails_the_store_cleanly(services_no_spill):
    services = services_no_spill
    region = PrimaryRegion(16, BLOCK)
    tier = TierFactory.create_tier({"type": "object_store", "capacity_bytes": 48 * MiB}, region.view, services=services)
    driver = TierDriver(tier)
    keys = prefix_keys(list(range(80)), 10)
    for i in range(8):
        region.array[i] = np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)
    try:
        ballast = _fill_plasma()
        full = driver.store(keys, list(range(8)), timeout=120)
        assert not full.success
        assert "object store is full" in (full.error or ""), full.error
        assert services.directory.lookup(scoped_keys(keys)) == [[] for _ in keys], "a failed store registered keys"
        assert driver.lookup(keys[:1]) == [LookupResult.MISS]
        stats = tier.stats().figures
        assert stats["blocks"] == 0 and stats["bytes_used"] == 0, stats
        assert stats["counters"].get("store_errors") == 1, stats["counters"]

        del ballast  # plasma frees the driver's objects (soon, not at once): the same tier stores again
        tries: list[str | None] = []

        def stored() -> bool:
            ok = driver.store(keys, list(range(8)), timeout=120)
            tries.append(ok.error)
            return ok.success

        try:
            wait_until(stored, timeout_s=60, interval_s=0.5, what="a store once plasma has room")
        except WaitTimeout as e:
            raise AssertionError(f"{e}; the last stores' errors: {tries[-3:]}") from None
        assert driver.lookup(keys) == [LookupResult.HIT] * len(keys)
        loaded = driver.load(keys, list(range(8, 16)))
        assert loaded.success, loaded.error
        assert np.array_equal(region.array[8:16], region.array[:8])
        print(
            f"\nfull object store -> failed store: {full.error[:120]!r};"
            " after freeing plasma: stored and loaded 8 x 1 MiB"
        )
    finally:
        tier.shutdown()
        region.close()
