"""The vectorised fingerprint table and holder sets against plain-Python models."""

from __future__ import annotations

import numpy as np

from raykv.directory.fingerprint import EMPTY, fingerprint, fingerprints
from raykv.directory.fptable import MAX_LOAD, FingerprintTable
from raykv.directory.holdersets import HolderSets


def test_table_matches_a_dict_through_growth_and_rebuilds():
    rng = np.random.default_rng(7)
    table = FingerprintTable()
    model: dict[int, int] = {}
    universe = np.unique(rng.integers(1, 2**64 - 1, 60_000, dtype=np.uint64))
    for round_ in range(40):
        batch = rng.choice(universe, 3000, replace=False)
        if round_ % 3 == 2:  # drop some entries (value 0 = dead slot)
            pos = table.find(batch)
            pos = pos[pos >= 0]
            table.values[pos] = 0
            for f in table.flat_fps[pos].tolist():
                model.pop(f, None)
            continue
        table.reserve(len(batch))
        pos = table.find(batch)
        absent = pos < 0
        pos[absent] = table.insert(batch[absent])
        table.values[pos] = round_ + 1
        model.update(dict.fromkeys(batch.tolist(), round_ + 1))
        assert table.used <= MAX_LOAD * table.capacity
    pos = table.find(universe)
    got = np.where(pos >= 0, table.values[pos], 0)
    assert got.tolist() == [model.get(f, 0) for f in universe.tolist()]


def test_colliding_home_buckets_all_land_and_are_found():
    table = FingerprintTable(1024)
    fps = (np.arange(1, 400, dtype=np.uint64) << np.uint64(20)) | np.uint64(5)  # one home bucket
    table.reserve(len(fps))
    slots = table.insert(fps)
    assert len(set(slots.tolist())) == len(fps)
    assert (table.find(fps) == slots).all()
    assert (table.find(fps + np.uint64(1)) == -1).all()


def test_fingerprint_covers_the_whole_key():
    """Keys equal but for their 8-byte identity tag (or any other byte) differ."""
    body = bytes(range(36))
    keys = [bytes([i]) * 8 + body for i in range(256)] + [body[:-1] + bytes([i]) for i in range(256)]
    fps = fingerprints(keys)
    assert len(set(fps.tolist())) == len(keys)
    assert EMPTY not in fps.tolist()
    assert fingerprint(keys[3]) == int(fps[3])


def test_holder_sets_intern_and_transition():
    sets = HolderSets()
    ids = np.zeros(5, dtype=np.uint32)
    a = sets.with_slot(ids, 3)
    assert len(set(a.tolist())) == 1 and sets.slots(int(a[0])) == {3}
    b = sets.with_slot(a[:2], 9)
    assert sets.slots(int(b[0])) == {3, 9}
    assert sets.has(np.concatenate([a, b]), 9).tolist() == [False] * 5 + [True] * 2
    assert sets.without_slot(sets.without_slot(b, 3), 9).tolist() == [0, 0]
