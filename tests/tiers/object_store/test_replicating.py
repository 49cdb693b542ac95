"""``replicate``'s plain part, without Ray: the pulled blocks per block size in
the order of the keys asked, and gathered byte-exact out of their packs' pieces."""

from __future__ import annotations

import numpy as np

from tiers.object_store import packing
from tiers.object_store.copying import FetchedPack
from tiers.object_store.replicating import found_blocks, gather

BLOCK = 3000


def _pack(blocks: np.ndarray, items: list[tuple[int, int]], piece_bytes: int = 4096) -> FetchedPack:
    """A pack of ``blocks`` (rows) as ``ray.get`` returns it: pieces and their ends."""
    pieces = packing.plan_pieces(list(range(len(blocks))), BLOCK, piece_bytes)
    flat = blocks.reshape(-1)
    return FetchedPack([flat[a:b].copy() for a, b in pieces], packing.piece_ends(pieces), BLOCK, items)


def test_found_blocks_follow_the_keys_and_gather_copies_them_exactly() -> None:
    rng = np.random.default_rng(3)
    p1, p2 = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8), rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
    keys = [b"k0", b"k1", b"k2", b"k3", b"k4"]
    # k3 is in no pack (not found); k0 is in both (the first answer counts)
    fetched = [_pack(p1, [(2, 3), (0, 1), (4, 0)]), _pack(p2, [(1, 1), (0, 0)])]
    found = found_blocks(keys, fetched)
    assert list(found) == [BLOCK]
    blocks = found[BLOCK]
    assert [b.key for b in blocks] == [b"k0", b"k1", b"k2", b"k4"]
    rows = gather(blocks, BLOCK)
    assert rows.shape == (4, BLOCK)
    assert np.array_equal(rows, np.stack([p1[1], p2[1], p1[3], p1[0]]))


def test_found_blocks_group_by_block_size() -> None:
    small = FetchedPack([np.arange(8, dtype=np.uint8)], [8], 4, [(1, 0), (0, 1)])
    big = _pack(np.zeros((1, BLOCK), dtype=np.uint8), [(2, 0)])
    found = found_blocks([b"a", b"b", b"c"], [big, small])
    assert {size: [b.key for b in bs] for size, bs in found.items()} == {BLOCK: [b"c"], 4: [b"a", b"b"]}
    assert gather(found[4], 4).tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]
