"""The object store actor's pack store, without Ray: what a store and a load decide.

``PackStore`` is given a dict-backed ``put`` (the actor gives it ``ray.put``):
its refs are dict keys, and a test "fetches" a pack by reading the dict.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tiers.object_store.copying import FetchedPack, copy_packs
from tiers.object_store.messages import DEFAULT_SETTINGS, ObjectStoreSettings, PackRef
from tiers.object_store.pack_store import PackStore, StoreRefused, registering
from tiers.object_store.tier import ObjectStoreOptions

BLOCK = 100


class DictPut:
    """A tiny object store: ``put`` keeps a copy of the value under a new id."""

    def __init__(self) -> None:
        self.objects: dict[int, list[np.ndarray]] = {}

    def __call__(self, value: object) -> object:
        assert isinstance(value, list)
        ref = len(self.objects)
        self.objects[ref] = [np.array(piece, copy=True) for piece in value]  # what plasma would hold
        return ref

    def fetch(self, packs: list[PackRef]) -> list[FetchedPack]:
        return [FetchedPack(self.objects[p.ref], p.ends, p.block_bytes, p.items) for p in packs]


def settings(capacity: int, **kw: object) -> ObjectStoreSettings:
    return dataclasses.replace(ObjectStoreSettings(capacity_bytes=capacity), **kw)


def region(n: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def store(ps: PackStore, ks: list[bytes], chunks: list[int], array: np.ndarray, tenant: str = "") -> list[bytes]:
    """One store as the actor runs it (no directory): the evicted keys."""
    plan = ps.plan_store(ks, chunks, len(array), BLOCK, tenant)
    evicted, _ = ps.make_room(plan)
    if not ps.has_room(plan):
        raise ps.no_room(plan)
    ps.add(ps.put_packs(array, plan))
    return evicted


def test_round_trip_is_byte_identical_across_packs_and_pieces():
    put = DictPut()
    # 3 blocks per pack, pieces of 64 bytes: blocks straddle pieces
    ps = PackStore(settings(10 * BLOCK, max_pack_bytes=3 * BLOCK, piece_bytes=64), put)
    src = region(seed=1)
    ks = keys("k", 7)
    chunks = [4, 5, 6, 0, 9, 10, 2]
    assert store(ps, ks, chunks, src) == []
    assert ps.index.num_packs == 3 and len(put.objects) == 3  # 3 + 3 + 1 blocks
    assert ps.index.used == 7 * BLOCK and len(ps.index) == 7

    dst = np.zeros_like(src)
    slots = [15, 14, 13, 12, 11, 1, 3]
    plan = ps.plan_load(ks, slots, len(dst))
    assert plan.remote == [] and plan.errors == {}
    assert sorted(i for p in plan.local for i, _ in p.items) == list(range(7))
    ok, bad = copy_packs(dst, BLOCK, slots, put.fetch(plan.local), deadline=None)
    assert sorted(ok) == list(range(7)) and bad == {}
    for c, s in zip(chunks, slots):
        assert np.array_equal(dst[s], src[c])


def test_plan_store_skips_held_and_repeated_keys_and_touches_held():
    ps = PackStore(settings(4 * BLOCK), DictPut())
    src = region()
    store(ps, [b"a"], [0], src)
    store(ps, [b"b"], [1], src)
    store(ps, [b"c", b"d"], [2, 3], src)
    plan = ps.plan_store([b"a", b"e", b"e", b"a"], [0, 4, 5, 6], len(src), BLOCK, "")
    assert plan.new_keys == [b"e"] and plan.new_chunks == [4] and plan.held == [b"a"]
    assert plan.nbytes == BLOCK
    # a was touched: b's pack is now the least recently used, so making room for e evicts it, not a's
    evicted, dropped = ps.make_room(plan)
    assert evicted == [b"b"] and len(dropped) == 1
    assert ps.lost(plan) == [] and ps.index.keys() == [b"c", b"d", b"a"]


def test_plan_store_refuses_a_chunk_out_of_range_before_touching_anything():
    ps = PackStore(settings(4 * BLOCK), DictPut())
    store(ps, [b"a"], [0], region())
    store(ps, [b"b"], [1], region())
    with pytest.raises(StoreRefused, match=r"chunk id 16 out of range \[0, 16\)") as info:
        ps.plan_store([b"a", b"z"], [0, 16], 16, BLOCK, "")
    assert info.value.counter is None
    assert ps.index.keys() == [b"a", b"b"]  # a was not touched


def test_a_store_bigger_than_the_capacity_evicts_nothing():
    ps = PackStore(settings(4 * BLOCK), DictPut())
    src = region()
    store(ps, keys("k", 3), [0, 1, 2], src)
    plan = ps.plan_store(keys("n", 5), [3, 4, 5, 6, 7], len(src), BLOCK, "")
    with pytest.raises(StoreRefused, match="store of 5 blocks needs 500 bytes but the capacity") as info:
        ps.make_room(plan)
    assert info.value.counter == "store_too_big"
    assert len(ps.index) == 3 and ps.index.used == 3 * BLOCK


def test_eviction_takes_whole_lru_packs_and_reports_lost_held_keys():
    ps = PackStore(settings(4 * BLOCK), DictPut())
    src = region()
    store(ps, [b"a", b"b"], [0, 1], src)
    store(ps, [b"c", b"d"], [2, 3], src)
    # the job holds b (pack a+b) but needs 4 blocks of room: both packs go, b among them
    plan = ps.plan_store([b"b", b"w", b"x", b"y", b"z"], [1, 4, 5, 6, 7], len(src), BLOCK, "")
    evicted, dropped = ps.make_room(plan)
    assert sorted(evicted) == [b"a", b"b", b"c", b"d"] and len(dropped) == 2
    assert ps.has_room(plan) and ps.lost(plan) == [b"b"]
    ps.add(ps.put_packs(src, plan))
    assert ps.index.used == 4 * BLOCK <= ps.index.capacity


def test_tenant_over_quota_evicts_its_own_and_other_quotas_leave_no_room():
    ps = PackStore(settings(6 * BLOCK, tenant_quotas={"a": 4 * BLOCK, "b": 4 * BLOCK}), DictPut())
    src = region()
    b_keys = keys("b", 3)
    store(ps, b_keys, [0, 1, 2], src, "b")
    a1 = keys("a1-", 2)
    store(ps, a1, [3, 4], src, "a")
    a2 = keys("a2-", 1)
    store(ps, a2, [5], src, "a")  # full now: 3 of b, 3 of a
    # a stores 2 more: over its quota, so its own oldest pack goes, never b's
    evicted = store(ps, keys("a3-", 2), [6, 7], src, "a")
    assert evicted == a1 and all(k in ps.index for k in b_keys)
    # a asks for 4 blocks: all of a's go and there is still no room (b is within its quota)
    plan = ps.plan_store(keys("a4-", 4), [8, 9, 10, 11], len(src), BLOCK, "a")
    evicted, _ = ps.make_room(plan)
    assert len(evicted) == 3 and not ps.has_room(plan)
    refused = ps.no_room(plan)
    assert refused.counter == "store_no_room" and "tenant 'a'" in refused.why
    assert all(k in ps.index for k in b_keys)
    with pytest.raises(StoreRefused, match="quota") as info:
        ps.make_room(ps.plan_store(keys("a5-", 5), list(range(5)), len(src), BLOCK, "a"))
    assert info.value.counter == "store_too_big"
    assert ps.report()["tenant_bytes"] == {"b": 3 * BLOCK}


def test_plan_load_splits_local_remote_and_out_of_range():
    put = DictPut()
    ps = PackStore(settings(8 * BLOCK, max_pack_bytes=2 * BLOCK), put)
    src = region()
    store(ps, [b"a", b"b", b"c"], [0, 1, 2], src)  # packs a+b, c
    store(ps, [b"d"], [3], src)
    plan = ps.plan_load([b"c", b"x", b"a", b"b", b"y"], [0, 1, 2, 99, 4], 16)
    assert plan.remote == [1, 4] and list(plan.errors) == [3] and "out of range" in plan.errors[3]
    items = {p.ref: p.items for p in plan.local}
    assert items == {0: [(2, 0)], 1: [(0, 0)]}  # pack 0 holds a (index 0), pack 1 holds c
    # loaded keys count as used: d, b now least recent, then c and a
    assert ps.index.keys()[:2] == [b"b", b"d"]


def test_refs_for_names_positions_of_the_keys_asked_and_touches_them():
    ps = PackStore(settings(8 * BLOCK), DictPut())
    src = region()
    store(ps, [b"a", b"b"], [0, 1], src)
    store(ps, [b"c"], [2], src)
    refs, found = ps.refs_for([b"zz", b"c", b"b", b"a"])
    assert found == 3
    by_ref = {r.ref: r for r in refs}
    assert by_ref[0].items == [(2, 1), (3, 0)] and by_ref[1].items == [(1, 0)]
    assert by_ref[0].block_bytes == BLOCK and by_ref[0].ends[-1] == 2 * BLOCK
    assert ps.index.keys() == [b"c", b"b", b"a"]  # touched in the order asked
    assert ps.refs_for([b"nope"]) == ([], 0)


def test_remove_prefixed_frees_packs_whose_keys_all_go():
    ps = PackStore(settings(8 * BLOCK), DictPut())
    src = region()
    store(ps, [b"t1-a", b"t2-a"], [0, 1], src)
    store(ps, [b"t1-b"], [2], src)
    removed, dropped = ps.remove_prefixed([b"t1-"])
    assert sorted(removed) == [b"t1-a", b"t1-b"] and len(dropped) == 1  # the t1-b pack; t2-a keeps the other
    assert ps.index.keys() == [b"t2-a"] and ps.index.used == 2 * BLOCK


def test_fit_to_node_caps_the_capacity_at_the_fraction_of_the_node():
    ps = PackStore(settings(1000, max_object_store_fraction=0.5), DictPut())
    assert ps.fit_to_node(0) is None and ps.index.capacity == 1000  # unknown: keep
    assert ps.fit_to_node(4000) is None and ps.index.capacity == 1000
    note = ps.fit_to_node(1000)
    assert ps.index.capacity == 500 and note is not None and "using 500" in note


def test_registering_lists_only_registrations_in_flight():
    import asyncio

    async def run() -> None:
        ps = PackStore(settings(8 * BLOCK), DictPut())
        src = region()
        store(ps, [b"a"], [0], src)
        store(ps, [b"b"], [1], src)
        packs = [ps.index.get(k)[0] for k in (b"a", b"b")]
        loop = asyncio.get_running_loop()
        pending, done = loop.create_future(), loop.create_future()
        done.set_result([1])
        packs[0].registering, packs[1].registering = pending, done
        assert registering(packs) == [pending]
        pending.set_result([1])
        assert registering(packs) == []

    asyncio.run(run())


def test_options_build_the_settings_and_defaults_are_stated_once():
    assert ObjectStoreOptions().actor_settings() == DEFAULT_SETTINGS
    opts = ObjectStoreOptions(capacity_bytes=5, job_timeout_s=8.0, tenant_quotas={"a": 3})
    s = opts.actor_settings()
    assert s.capacity_bytes == 5 and s.remote_timeout_s == 4.0 and dict(s.tenant_quotas) == {"a": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.capacity_bytes = 6
