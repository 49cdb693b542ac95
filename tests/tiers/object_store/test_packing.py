"""Packing blocks into pieces and the pack index's LRU/capacity rules (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from tiers.object_store.packing import (
    CapacityError,
    Pack,
    PackIndex,
    copy_block,
    piece_ends,
    piece_views,
    plan_pieces,
)


def test_plan_coalesces_consecutive_chunks_and_cuts_pieces():
    # chunks 3,4,5 are one run; 9 alone; 1 MiB blocks cut at 1 MiB: one piece per block
    assert plan_pieces([3, 4, 5, 9], 100, piece_bytes=1000) == [(300, 600), (900, 1000)]
    assert plan_pieces([3, 4, 5, 9], 100, piece_bytes=150) == [(300, 450), (450, 600), (900, 1000)]
    assert plan_pieces([2, 1], 10, piece_bytes=64) == [(20, 30), (10, 20)]  # order kept
    assert plan_pieces([], 10) == []


@pytest.mark.parametrize("piece_bytes", [7, 64, 100, 1000])
def test_blocks_come_back_byte_identical(piece_bytes):
    bpc, chunks = 100, [5, 6, 7, 0, 9, 3, 4]
    region = np.random.default_rng(1).integers(0, 256, (10, bpc), dtype=np.uint8)
    plan = plan_pieces(chunks, bpc, piece_bytes)
    assert all(b - a <= piece_bytes for a, b in plan)
    pieces = [p.copy() for p in piece_views(region.reshape(-1), plan)]  # what plasma would hold
    ends = piece_ends(plan)
    assert ends[-1] == len(chunks) * bpc
    for j, c in enumerate(chunks):
        out = np.zeros(bpc, np.uint8)
        copy_block(pieces, ends, j, bpc, out)
        assert np.array_equal(out, region[c])
    with pytest.raises(ValueError):
        copy_block(pieces, ends, len(chunks), bpc, np.zeros(bpc, np.uint8))


def _pack(pid: int, keys: list[bytes], block: int = 10) -> Pack:
    return Pack(pid, None, keys, block, [len(keys) * block])


def test_index_evicts_whole_lru_packs_and_never_exceeds_capacity():
    idx = PackIndex(capacity_bytes=40)
    idx.add(_pack(0, [b"a", b"b"]))
    idx.add(_pack(1, [b"c", b"d"]))
    assert idx.used == 40 and len(idx) == 4
    idx.touch([b"b", b"a"])  # LRU key is now c (pack 1): evicting it frees pack 1 whole
    keys, packs = idx.evict_for(10)
    assert sorted(keys) == [b"c", b"d"] and [p.pack_id for p in packs] == [1]
    assert idx.used == 20 and b"a" in idx and b"c" not in idx
    idx.add(_pack(2, [b"e"]))
    assert idx.used == 30 <= idx.capacity
    with pytest.raises(CapacityError):
        idx.evict_for(41)
    assert idx.used == 30  # a store bigger than the capacity evicts nothing
    keys, _ = idx.evict_for(40)
    assert set(keys) == {b"a", b"b", b"e"} and idx.used == 0 and idx.evicted_keys == 5


def test_index_frees_a_pack_when_its_last_key_goes():
    idx = PackIndex(capacity_bytes=100)
    idx.add(_pack(0, [b"a", b"b", b"c"]))
    removed, dropped = idx.remove([b"a", b"b", b"zz"])
    assert removed == [b"a", b"b"] and dropped == [] and idx.used == 30
    removed, dropped = idx.remove([b"c"])
    assert [p.pack_id for p in dropped] == [0] and idx.used == 0 and idx.num_packs == 0
    with pytest.raises(ValueError):
        idx.add(_pack(1, [b"x"]))
        idx.add(_pack(2, [b"x"]))
