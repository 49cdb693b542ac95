"""Copying fetched packs into primary slots (no Ray): shares over threads,
the load deadline, block size mismatches and packs that could not be fetched."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np

from tiers.object_store import copying
from tiers.object_store.copying import FetchedPack, copy_packs, received
from tiers.object_store.messages import PackRef
from tiers.object_store.packing import piece_ends, piece_views, plan_pieces

BLOCK = 256


def pack_of(src: np.ndarray, chunks: list[int], items: list[tuple[int, int]]) -> FetchedPack:
    plan = plan_pieces(chunks, BLOCK, piece_bytes=100)
    pieces = [p.copy() for p in piece_views(src.reshape(-1), plan)]
    return FetchedPack(pieces, piece_ends(plan), BLOCK, items)


def test_copy_lands_each_block_in_its_slot():
    src = np.random.default_rng(2).integers(0, 256, (8, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    # load positions 0..3 -> slots; pack blocks are chunks 5, 6, 1 of src
    packs = [pack_of(src, [5, 6, 1], [(0, 2), (2, 0)]), pack_of(src, [3], [(3, 0)])]
    ok, bad = copy_packs(dst, BLOCK, [7, 99, 4, 0], packs, deadline=time.time() + 60)
    assert sorted(ok) == [0, 2, 3] and bad == {}
    assert np.array_equal(dst[7], src[1]) and np.array_equal(dst[4], src[5]) and np.array_equal(dst[0], src[3])


def test_nothing_is_copied_after_the_deadline_or_into_other_block_sizes():
    src = np.random.default_rng(3).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    pack = pack_of(src, [0, 1], [(0, 0), (1, 1)])
    ok, bad = copy_packs(dst, BLOCK, [2, 3], [pack], deadline=time.time() - 1)
    assert ok == [] and set(bad) == {0, 1} and "deadline" in bad[0]
    assert not dst.any()
    ok, bad = copy_packs(dst, BLOCK, [2, 3], [pack._replace(block_bytes=BLOCK // 2)], deadline=None)
    assert ok == [] and "128 bytes, primary chunks have 256" in bad[1]


def test_shares_spread_every_packs_blocks_and_merge_back():
    packs = [FetchedPack([], [], BLOCK, [(i, i) for i in range(5)]), FetchedPack([], [], BLOCK, [(9, 0)])]
    assert copying.split(packs, 1) == [packs]
    shares = copying.split(packs, 2)
    assert [[p.items for p in share] for share in shares] == [
        [[(0, 0), (2, 2), (4, 4)], [(9, 0)]],
        [[(1, 1), (3, 3)], []],
    ]
    assert copying.merge([([1], {2: "x"}), ([3], {4: "y"})]) == ([1, 3], {2: "x", 4: "y"})
    small = [FetchedPack([], [], 1024, [(0, 0)])]
    big = [FetchedPack([], [], 4 << 20, [(i, i) for i in range(64)])]
    assert copying.threads_for(small, 1024) == 1
    assert copying.threads_for(big, 4 << 20) == copying.COPY_THREADS


def test_copy_in_threads_gives_the_same_bytes_as_one_thread():
    src = np.random.default_rng(4).integers(0, 256, (64, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    chunks = list(range(64))
    packs = [pack_of(src, chunks, [(i, i) for i in range(64)])]
    copying.PARALLEL_COPY_BYTES, old = BLOCK * 8, copying.PARALLEL_COPY_BYTES  # force several shares
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            ok, bad = asyncio.run(copying.copy_in_threads(pool, dst, BLOCK, chunks[::-1], packs, None))
    finally:
        copying.PARALLEL_COPY_BYTES = old
    assert sorted(ok) == chunks and bad == {}
    assert np.array_equal(dst, src[::-1])


def test_packs_that_could_not_be_fetched_fail_their_keys():
    refs = [PackRef("a", [BLOCK], BLOCK, [(0, 0), (3, 1)]), PackRef("b", [BLOCK], BLOCK, [(1, 0)])]
    errors: dict[int, str] = {}
    ready = received(refs, [TimeoutError(), [np.zeros(BLOCK, np.uint8)]], "pull failed", errors)
    assert errors == {0: "pull failed: TimeoutError", 3: "pull failed: TimeoutError"}
    assert len(ready) == 1 and ready[0].items == [(1, 0)] and len(ready[0].pieces) == 1


def test_a_copy_that_began_in_time_stops_at_the_deadline(monkeypatch):
    """The deadline is read per block: a long copy cannot run past it into slots the engine reuses."""
    src = np.random.default_rng(4).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    pack = pack_of(src, [0, 1, 2], [(0, 0), (1, 1), (2, 2)])
    deadline = 1000.0
    clock = iter([deadline - 1, deadline + 1, deadline + 2])  # the first block in time, then past it
    monkeypatch.setattr(copying.time, "time", lambda: next(clock))
    ok, bad = copy_packs(dst, BLOCK, [0, 1, 2], [pack], deadline=deadline)
    assert ok == [0] and set(bad) == {1, 2} and "deadline" in bad[1]
    assert np.array_equal(dst[0], src[0]) and not dst[1:].any()
