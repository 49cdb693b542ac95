"""``FingerprintTable``: an open-addressing hash table over numpy arrays.

Maps 64-bit fingerprints to a ``uint32`` value per entry, probed and updated a
batch at a time. Slots come in buckets of ``BUCKET`` (8 fingerprints: one
64-byte cache line); a key's home bucket is picked by its fingerprint's low
bits and, when full, the next buckets in turn. A probe round gathers one
bucket row per key and compares it whole, so a batch needs a few rounds
(almost always one) however large it is. 12 bytes per slot, kept at most
``MAX_LOAD`` full: 14-28 bytes per live key.

Entries never move out of a probe chain: an entry whose value drops to 0
stays as a dead slot until the next rebuild (``reserve`` rebuilds, dropping
dead slots, when the table would pass ``MAX_LOAD``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from raykv.directory.fingerprint import EMPTY

#: ``allocate(buckets) -> (fps, vals)``: zeroed ``(buckets, BUCKET)`` uint64 and uint32 arrays.
Allocate = Callable[[int], tuple[np.ndarray, np.ndarray]]

BUCKET = 8
MAX_LOAD = 0.85
#: A rebuild sizes the table so that at most this share of it is used.
REBUILD_LOAD = 0.5
MIN_BUCKETS = 128


def _any_per_row(eq: np.ndarray) -> np.ndarray:
    """``eq.any(axis=1)``; a C-contiguous ``(n, 8)`` bool array is read as one word per row."""
    if eq.shape[1] == 8 and eq.flags.c_contiguous:
        return eq.view(np.uint64).reshape(-1) != 0
    return np.asarray(eq.any(axis=1))


class FingerprintTable:
    """Fingerprint -> uint32 value; value 0 means "no entry" to callers.

    ``fps`` and ``values`` are ``(buckets, BUCKET)`` arrays; a slot number is
    ``bucket * BUCKET + column`` (index into ``fps.reshape(-1)``).
    """

    def __init__(self, capacity: int = MIN_BUCKETS * BUCKET, allocate: Allocate | None = None) -> None:
        #: Makes the zeroed ``(fps, vals)`` arrays of a given bucket count (None:
        #: private numpy arrays); a node's view puts them in shared memory.
        self._allocate = allocate
        nb = MIN_BUCKETS
        while nb * BUCKET < capacity:
            nb *= 2
        self._alloc(nb)

    @classmethod
    def over(cls, fps: np.ndarray, vals: np.ndarray) -> FingerprintTable:
        """A table over existing ``(buckets, BUCKET)`` arrays (a reader of a shared view)."""
        table = cls.__new__(cls)
        table._allocate, table.fps, table.vals, table.used = None, fps, vals, 0
        return table

    def _alloc(self, buckets: int) -> None:
        if self._allocate is None:
            self.fps = np.zeros((buckets, BUCKET), dtype=np.uint64)
            self.vals = np.zeros((buckets, BUCKET), dtype=np.uint32)
        else:
            self.fps, self.vals = self._allocate(buckets)
        self.used = 0  # slots with a fingerprint (live or dead)

    @property
    def values(self) -> np.ndarray:
        """Flat view of every slot's value (index by slot number)."""
        return self.vals.reshape(-1)

    @property
    def flat_fps(self) -> np.ndarray:
        return self.fps.reshape(-1)

    @property
    def capacity(self) -> int:
        return self.fps.size

    @property
    def nbytes(self) -> int:
        return self.fps.nbytes + self.vals.nbytes

    def find(self, fps: np.ndarray) -> np.ndarray:
        """Slot of each fingerprint (``int64``), -1 where absent."""
        table = self.fps
        mask = len(table) - 1
        out = np.full(len(fps), -1, dtype=np.int64)
        idx = np.arange(len(fps))
        bucket = (fps & np.uint64(mask)).astype(np.int64)
        want = fps
        while len(idx):
            rows = np.take(table, bucket, axis=0)  # about twice as fast as table[bucket]
            eq = rows == want[:, None]
            hit = _any_per_row(eq)
            if hit.any():
                out[idx[hit]] = bucket[hit] * BUCKET + eq[hit].argmax(axis=1)
            go_on = ~hit & (rows[:, -1] != EMPTY)  # a full bucket: look in the next one
            idx, want = idx[go_on], want[go_on]
            bucket = (bucket[go_on] + 1) & mask
        return out

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` new entries; True when the table was rebuilt
        (slots found before this call are stale then)."""
        if self.used + n <= MAX_LOAD * self.capacity:
            return False
        self.compact(n)
        return True

    def compact(self, n: int = 0) -> None:
        """Rebuild now, sized for the live entries and ``n`` more: dead slots
        (value 0) go, and a table that shrank gets smaller."""
        live = self.values != 0
        fps, values = self.flat_fps[live], self.values[live]
        nb = MIN_BUCKETS
        while REBUILD_LOAD * nb * BUCKET < len(fps) + n:
            nb *= 2
        self._alloc(nb)
        self.values[self._fill(fps)] = values

    def _fill(self, fps: np.ndarray) -> np.ndarray:
        """``insert`` into an empty table: round ``c`` places one more key per
        bucket in column ``c`` (no bucket rows to read); overflow goes through
        ``insert``."""
        flat = self.flat_fps
        mask = np.uint64(len(self.fps) - 1)
        out = np.empty(len(fps), dtype=np.int64)
        idx = np.arange(len(fps))
        base = (fps & mask).astype(np.int64) * BUCKET
        want = fps
        for col in range(BUCKET):
            if not len(idx):
                break
            slot = base + col
            flat[slot] = want
            won = flat[slot] == want
            out[idx[won]] = slot[won]
            lost = ~won
            idx, base, want = idx[lost], base[lost], want[lost]
        self.used += len(fps) - len(idx)
        if len(idx):
            out[idx] = self.insert(want)
        return out

    def insert(self, fps: np.ndarray) -> np.ndarray:
        """Add fingerprints that are absent and distinct (value 0); returns their
        slots. Call ``reserve(len(fps))`` first."""
        return self.upsert(fps)

    def upsert(self, fps: np.ndarray) -> np.ndarray:
        """Slot of each of ``fps`` (distinct), adding those that are absent:
        one probe pass for both. Call ``reserve(len(fps))`` first."""
        table = self.fps
        flat = self.flat_fps
        mask = len(table) - 1
        out = np.empty(len(fps), dtype=np.int64)
        idx = np.arange(len(fps))
        bucket = (fps & np.uint64(mask)).astype(np.int64)
        want = fps
        added = 0
        while len(idx):
            rows = np.take(table, bucket, axis=0)
            eq = rows == want[:, None]
            hit = _any_per_row(eq)
            done = hit.copy()
            if hit.any():
                out[idx[hit]] = bucket[hit] * BUCKET + eq[hit].argmax(axis=1)
            free = rows == EMPTY
            has_free = free[:, -1]  # buckets fill from column 0
            cand = np.flatnonzero(has_free & ~hit)
            if len(cand):
                # Several keys may claim one slot in a round: the write that
                # sticks wins, the others look at the bucket again.
                slot = bucket[cand] * BUCKET + free[cand].argmax(axis=1)
                flat[slot] = want[cand]
                won = flat[slot] == want[cand]
                out[idx[cand[won]]] = slot[won]
                done[cand[won]] = True
                added += int(won.sum())
            keep = ~done
            step = (~has_free[keep]).astype(np.int64)
            idx, want = idx[keep], want[keep]
            bucket = (bucket[keep] + step) & mask
        self.used += added
        return out
