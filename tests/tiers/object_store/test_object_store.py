"""The object store tier on a real single-node Ray: round trip, eviction,
job results under failures, and the death of the node's actor."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import raykv
from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import prefix_keys
from raykv.core.pins import Unpin
from raykv.core.units import fmt_bytes
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.waiting import wait_until
from tiers.object_store import ObjectStoreTier

MiB = 1 << 20


@pytest.fixture
def fresh_raykv(ray_local):
    """raykv in a namespace of its own (so each test gets its own node actor)."""
    started = []

    def make(namespace: str):
        services = raykv.start({"namespace": namespace, "directory_shards": 2})
        started.append(services)
        return services

    yield make
    for services in started:
        services.shutdown()


@pytest.fixture
def regions():
    made: list[PrimaryRegion] = []

    def make(num_chunks: int, bytes_per_chunk: int, seed: int | None = None) -> PrimaryRegion:
        region = PrimaryRegion(num_chunks, bytes_per_chunk)
        if seed is not None:
            region.array[:] = np.random.default_rng(seed).integers(0, 256, region.array.shape, dtype=np.uint8)
        made.append(region)
        return region

    yield make
    for region in made:
        region.close()


def make_tier(services, region: PrimaryRegion, **options) -> ObjectStoreTier:
    tier = TierFactory.create_tier({"type": "object_store", **options}, region.view, services=services)
    assert isinstance(tier, ObjectStoreTier)
    return tier


def keys_of(start: int, n: int) -> list[bytes]:
    return prefix_keys(list(range(start, start + n * 4)), 4)


def holders_of(services, keys) -> list[list[str]]:
    """Fresh from the directory (no cache): the tier types holding each key."""
    return [[h.tier_type for h in hs] for hs in services.directory.lookup(scoped_keys(keys))]


def register_calls(services) -> int:
    return sum(s.calls.get("register", 0) for s in services.directory.stats())


def test_store_lookup_load_byte_identical(raykv_services, regions):
    src = regions(16, 2 * MiB, seed=7)
    dst = regions(16, 2 * MiB)
    tier = make_tier(raykv_services, src)
    reader = make_tier(raykv_services, dst)
    keys = keys_of(0, 8)
    chunks = [0, 1, 2, 3, 9, 11, 12, 15]  # runs and singles

    before = register_calls(raykv_services)
    t0 = time.perf_counter()
    res = TierDriver(tier).store(keys, chunks)
    store_s = time.perf_counter() - t0
    assert res.success, res.error
    assert res.transfer_bytes == 8 * 2 * MiB
    # one batched register per job (one call per directory shard at most)
    assert register_calls(raykv_services) - before <= raykv_services.directory.num_shards

    raykv_services.lookup_cache.invalidate(scoped_keys(keys))  # ask the directory, not our own note
    missing = keys_of(1000, 1)
    assert reader.lookup_blocking(keys + missing) == [LookupResult.HIT] * 8 + [LookupResult.MISS]

    slots = [15, 14, 13, 12, 3, 2, 1, 0]
    t0 = time.perf_counter()
    res = TierDriver(reader).load(keys, slots)
    load_s = time.perf_counter() - t0
    assert res.success, res.error
    for c, s in zip(chunks, slots):
        assert np.array_equal(dst.array[s], src.array[c])
    print(f"16 MiB: store {store_s * 1000:.1f} ms, load {load_s * 1000:.1f} ms (job round trips)")

    # storing the same keys again copies nothing
    res = TierDriver(tier).store(keys, chunks)
    assert res.success and res.transfer_bytes == 0
    stats = tier.stats().figures
    assert stats["blocks"] == 8 and stats["bytes_used"] == 16 * MiB and stats["packs"] == 1
    assert stats["hits"] == 8
    text = ray.get(tier.actor.__ray_call__.remote(lambda self: repr(self)))
    # what and where, and the capacity: never counts (the dashboard keeps a repr from the actor's start)
    assert text == f"ObjectStore(node={tier.node_id[:12]}, capacity {fmt_bytes(stats['capacity_bytes'])})", text


def test_lru_eviction_keeps_bytes_within_capacity(fresh_raykv, regions):
    services = fresh_raykv("raykv-os-evict")
    block = 256 * 1024
    src = regions(16, block, seed=3)
    dst = regions(16, block)
    tier = make_tier(services, src, capacity_bytes=4 * block)
    drv = TierDriver(tier)
    job1, job2, job3 = keys_of(0, 2), keys_of(100, 2), keys_of(200, 2)
    assert drv.store(job1, [0, 1]).success
    assert drv.store(job2, [2, 3]).success
    assert tier.stats().figures["bytes_used"] == 4 * block
    tier.touch(job1, ReqContext("r"))  # job2's pack is now the least recently used
    tier.on_schedule_end()
    # the touch is sent without waiting and the store comes from another thread:
    # Ray orders neither against the other, so let the touch land first
    wait_until(lambda: tier.stats().figures["counters"].get("touches", 0) >= 1, timeout_s=10, what="touch applied")
    assert drv.store(job3, [4, 5]).success
    stats = tier.stats().figures
    assert stats["bytes_used"] <= stats["capacity_bytes"] == 4 * block
    assert stats["evictions"] == 2 and stats["blocks"] == 4
    assert ray.get(tier.actor.holds.remote(scoped_keys(job1 + job2 + job3))) == [True] * 2 + [False] * 2 + [True] * 2
    # evicted keys are gone from the directory by the time the store reports
    assert holders_of(services, job2) == [[], []]
    assert holders_of(services, job1 + job3) == [["object_store"]] * 4

    # a load of evicted keys fails for those keys only
    res = TierDriver(make_tier(services, dst)).load([job1[0], job2[0], job3[1]], [0, 1, 2])
    assert not res.success and list(res.successful_keys) == [job1[0], job3[1]]
    assert np.array_equal(dst.array[0], src.array[0]) and np.array_equal(dst.array[2], src.array[5])

    # a store bigger than the whole capacity fails cleanly and evicts nothing
    res = drv.store(keys_of(300, 5), [6, 7, 8, 9, 10])
    assert not res.success and "capacity" in res.error
    assert tier.stats().figures["blocks"] == 4

    # many small stores: the bytes held never exceed the capacity
    for i in range(10):
        assert drv.store(keys_of(400 + 10 * i, 3), [11, 12, 13]).success
        stats = tier.stats().figures
        assert stats["bytes_used"] <= stats["capacity_bytes"]
    held = [hs for hs in holders_of(services, [k for i in range(10) for k in keys_of(400 + 10 * i, 3)]) if hs]
    assert len(held) == stats["blocks"] == 3  # only the last pack fits beside nothing else


def test_every_job_ends_in_exactly_one_result(raykv_services, regions):
    src = regions(32, 64 * 1024, seed=5)
    dst = regions(32, 64 * 1024)
    tier = make_tier(raykv_services, src)
    reader = make_tier(raykv_services, dst)
    stored = keys_of(5000, 12)
    missing = keys_of(9000, 3)
    ctx = ReqContext("jobs")
    jobs = []
    for i in range(4):  # stores of 3 keys each, all in flight at once
        job = TransferJob(100 + i, stored[3 * i : 3 * i + 3], np.arange(3 * i, 3 * i + 3), False, ctx)
        tier.submit_store(job)
        jobs.append(job)
    tier.drain_jobs(timeout=30)
    results = {r.job_id: r for r in tier.get_finished_jobs()}
    assert sorted(results) == [100, 101, 102, 103] and all(r.success for r in results.values())

    loads = [
        TransferJob(200, stored[:4], np.arange(4), True, ctx),  # all present
        TransferJob(201, missing, np.arange(4, 7), True, ctx),  # none present
        TransferJob(202, [stored[5], missing[0], stored[6]], np.arange(7, 10), True, ctx),  # partial
        TransferJob(203, [], np.zeros(0, np.int64), True, ctx),  # empty
        TransferJob(204, stored[:2], np.array([0, 99]), True, ctx),  # chunk out of range
        TransferJob(205, stored[:2], np.array([0]), True, ctx),  # malformed
    ]
    for job in loads:
        reader.submit_load(job)
    reader.drain_jobs(timeout=30)
    got = reader.get_finished_jobs()
    assert sorted(r.job_id for r in got) == [200, 201, 202, 203, 204, 205]  # exactly one each
    res = {r.job_id: r for r in got}
    assert res[200].success and res[203].success
    assert not res[201].success and list(res[201].successful_keys) == []
    assert not res[202].success and list(res[202].successful_keys) == [stored[5], stored[6]]
    assert not res[204].success and list(res[204].successful_keys) == [stored[0]]
    assert not res[205].success and "chunk ids" in res[205].error
    assert np.array_equal(dst.array[7], src.array[5]) and np.array_equal(dst.array[9], src.array[6])
    assert reader.get_finished_jobs() == [] and reader.jobs.num_pending == 0


def test_killed_actor_entries_vanish_and_jobs_fail(fresh_raykv, regions):
    services = fresh_raykv("raykv-os-kill")
    src = regions(8, 128 * 1024, seed=9)
    tier = make_tier(services, src)
    drv = TierDriver(tier)
    keys = keys_of(0, 6)
    assert drv.store(keys, list(range(6))).success
    assert holders_of(services, keys) == [["object_store"]] * 6

    # a load in flight while the actor dies still ends in exactly one result
    tier.submit_load(TransferJob(1, keys[:2], np.array([6, 7]), True, ReqContext("k")))
    ray.kill(tier.actor)
    t0 = time.monotonic()
    while any(holders_of(services, keys)):
        assert time.monotonic() - t0 < 1.0, "entries of a dead object store actor outlived 1 s"
    elapsed = time.monotonic() - t0
    print(f"directory entries gone {elapsed * 1000:.1f} ms after killing the object store actor")
    tier.drain_jobs(timeout=10)
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]

    # the tier notices within a step; later lookups miss, whether cached or fresh
    deadline = time.monotonic() + 5
    while tier.liveness.alive and time.monotonic() < deadline:
        tier.on_schedule_end()
    assert not tier.liveness.alive
    assert tier.lookup_blocking(keys) == [LookupResult.MISS] * 6
    services.lookup_cache.invalidate(scoped_keys(keys))
    assert tier.lookup_blocking(keys) == [LookupResult.MISS] * 6

    # stores and loads after the death fail fast instead of hanging
    t0 = time.monotonic()
    res = drv.store(keys_of(50, 2), [0, 1], timeout=10)
    assert not res.success and "unavailable" in res.error
    res = drv.load(keys[:2], [0, 1], timeout=10)
    assert not res.success and list(res.successful_keys or []) == []
    assert time.monotonic() - t0 < 5

    # a new engine on the node starts a fresh actor: the tier works again (empty)
    fresh = make_tier(services, src)
    assert fresh.lookup_blocking(keys) == [LookupResult.MISS] * 6
    assert TierDriver(fresh).store(keys[:2], [0, 1]).success
    assert holders_of(services, keys[:2]) == [["object_store"]] * 2


def test_unmapped_view_is_rejected(raykv_services):
    view = memoryview(bytearray(4 * 1024)).cast("B", (4, 1024))
    with pytest.raises(ValueError, match="object_store tier: .*shared-memory file"):
        make_tier(raykv_services, type("R", (), {"view": view})())


def test_pins_survive_a_flood_are_capped_expire_unpin_and_go_with_their_identity(fresh_raykv, regions):
    services = fresh_raykv("raykv-os-pins")
    block = 64 * 1024
    src = regions(16, block, seed=5)
    tier = make_tier(services, src, capacity_bytes=8 * block)  # max_pinned_fraction 0.5: 4 blocks
    drv = TierDriver(tier)
    pin_drv, short = TierDriver(tier, "pinned"), TierDriver(tier, "short")
    pin_drv.req = ReqContext("pinned", {"cache_ttl_s": 60})
    short.req = ReqContext("short", {"cache_ttl_s": 0.5})

    def holds(keys):
        return ray.get(tier.actor.holds.remote(scoped_keys(keys)))

    pinned, twin = keys_of(0, 2), keys_of(100, 2)
    assert pin_drv.store(pinned, [0, 1]).success
    assert drv.store(twin, [2, 3]).success  # the same age, unpinned
    for i in range(12):  # 24 blocks: three times the capacity
        assert drv.store(keys_of(1000 + 10 * i, 2), [4, 5]).success
    assert holds(pinned + twin) == [True, True, False, False]
    figures = tier.stats().figures
    assert figures["pinned_blocks"] == 2 and figures["tenant_pinned_bytes"] == {"": 2 * block}
    assert figures["pin_expiries"][0]["blocks"] == 2 and 0 < figures["pin_expiries"][0]["seconds_left"] <= 60

    # the tier cap: 4 blocks pinned at most; a refused pin is counted and the blocks still stored
    more, over = keys_of(200, 2), keys_of(300, 2)
    assert pin_drv.store(more, [6, 7]).success
    assert pin_drv.store(over, [8, 9]).success
    figures = tier.stats().figures
    assert figures["counters"]["pins_refused_tier_cap"] == 2 and figures["pinned_blocks"] == 4
    assert holds(over) == [True, True]

    # unpin by keys, then a touch by a request with a TTL pins them again
    assert tier.unpin(Unpin(keys=tuple(scoped_keys(more)))) == 2
    assert tier.stats().figures["pinned_blocks"] == 2
    tier.touch(more, pin_drv.req)
    tier.on_schedule_end()
    wait_until(lambda: tier.stats().figures["pinned_blocks"] == 4, timeout_s=10, what="touch pinned")

    # expiry: unpin all, pin with 0.5 s; after it, the next eviction pass takes it (the oldest)
    assert tier.unpin(Unpin(everything=True)) == 4
    exp = keys_of(400, 2)
    assert short.store(exp, [10, 11]).success
    for i in range(4):
        assert drv.store(keys_of(2000 + 10 * i, 2), [4, 5]).success
    assert holds(exp) == [True, True]
    time.sleep(0.6)
    assert holds(exp) == [True, True]  # no eviction pass since
    assert drv.store(keys_of(3000, 2), [4, 5]).success
    assert holds(exp) == [False, False]

    # invalidating the identity removes pinned blocks too
    assert pin_drv.store(pinned, [0, 1]).success
    assert tier.stats().figures["pinned_blocks"] == 2
    held = tier.stats().figures["blocks"]
    assert ray.get(tier.actor.drop_identities.remote([tier.key_tag])) == held
    figures = tier.stats().figures
    assert figures["blocks"] == 0 and figures["pinned_blocks"] == 0 and figures["pinned_bytes"] == 0
    assert holders_of(services, pinned) == [[], []]


def test_start_warns_when_a_node_caps_the_capacity(ray_local, caplog):
    """Asked for more than the node's plasma (512 MiB here) can hold: the tier
    runs capped, and ``raykv.start`` says so (the CLI prints the warning)."""
    caplog.set_level("WARNING", logger="raykv")
    services = raykv.start(
        {"namespace": "raykv-capped", "tiers": [{"type": "object_store", "capacity_bytes": "64GiB"}]}
    )
    try:
        capped = [r.getMessage() for r in caplog.records if "runs with capacity_bytes=" in r.getMessage()]
        assert len(capped) == 1, caplog.text
        assert "object_store tier on node" in capped[0] and "not the 64.0 GiB asked for" in capped[0]
        assert [h.tier_type for h in services.holders()] == ["object_store"]  # it runs, capped
    finally:
        services.shutdown()


def test_start_again_with_other_tier_settings_names_each_kept(ray_local, caplog, tmp_path):
    """``raykv start`` again with a tier's settings changed (an operator edits the config
    and runs it again): the running actors keep theirs, and the warning names each
    setting that differs. Before, the object store tier said nothing at all."""
    ns = "raykv-restart-settings"
    first = {"namespace": ns, "tiers": [{"type": "object_store", "capacity_bytes": "64MiB", "max_pack_bytes": "8MiB"}]}
    fs = {"type": "fs", "root": str(tmp_path), "capacity_bytes": "1GiB"}
    services = raykv.start({**first, "tiers": [*first["tiers"], fs]})
    try:
        caplog.set_level("WARNING", logger="raykv")
        raykv.start({**first, "tiers": [*first["tiers"], fs]})  # the same again: nothing to say
        assert not [r for r in caplog.records if "already runs" in r.getMessage()], caplog.text
        raykv.start(
            {
                "namespace": ns,
                "tiers": [
                    {"type": "object_store", "capacity_bytes": "128MiB", "max_pack_bytes": "8MiB"},
                    {**fs, "capacity_bytes": "2GiB", "tenant_quotas": {"a": "1GiB"}},
                ],
            }
        )
        said = [r.getMessage() for r in caplog.records if "already runs" in r.getMessage()]
        assert len(said) == 2, caplog.text
        assert said[0].startswith("object_store tier on node ") and said[0].endswith(
            "already runs with other settings: capacity_bytes 64.0 MiB (asked 128.0 MiB); keeping them "
            "(to change them: `raykv stop`, then `raykv start`)"
        ), said[0]
        assert "capacity_bytes 1.0 GiB (asked 2.0 GiB); tenant_quotas {} (asked {'a': 1073741824})" in said[1]
        (store,) = [h for h in services.holders() if h.tier_type == "object_store"]
        actor = ray.get_actor(store.actor_name, namespace=ns)
        assert ray.get(actor.ready.remote()).requested_capacity_bytes == 64 << 20  # kept
    finally:
        services.shutdown()
