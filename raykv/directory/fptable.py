"""``FingerprintTable``: an open-addressing hash table over numpy arrays.

Maps 64-bit fingerprints to a ``uint32`` value per entry, probed and updated a
batch at a time (vectorised linear probing: every round handles all keys of
the batch still looking). 12 bytes per slot, kept between 3/8 and 3/4 full, so
16-32 bytes per live key. Entries are never moved out of a probe chain: an
entry whose value drops to 0 stays as a dead slot until the next rebuild
(``reserve`` rebuilds, dropping dead slots, when the table would pass 3/4).
"""

from __future__ import annotations

import numpy as np

from raykv.directory.fingerprint import EMPTY

MAX_LOAD = 0.75
MIN_CAPACITY = 1024


class FingerprintTable:
    """Fingerprint -> uint32 value; value 0 means "no entry" to callers."""

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        cap = MIN_CAPACITY
        while cap < capacity:
            cap *= 2
        self.fps = np.zeros(cap, dtype=np.uint64)
        self.values = np.zeros(cap, dtype=np.uint32)
        self.used = 0  # slots with a fingerprint (live or dead)

    @property
    def capacity(self) -> int:
        return len(self.fps)

    @property
    def nbytes(self) -> int:
        return self.fps.nbytes + self.values.nbytes

    def find(self, fps: np.ndarray) -> np.ndarray:
        """Slot of each fingerprint (``int64``), -1 where absent."""
        table = self.fps
        mask = len(table) - 1
        out = np.full(len(fps), -1, dtype=np.int64)
        idx = np.arange(len(fps))
        pos = (fps & np.uint64(mask)).astype(np.int64)
        want = fps
        while len(idx):
            cur = table[pos]
            hit = cur == want
            out[idx[hit]] = pos[hit]
            go_on = ~hit & (cur != EMPTY)
            idx, want = idx[go_on], want[go_on]
            pos = (pos[go_on] + 1) & mask
        return out

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` new entries; True when the table was rebuilt
        (slots found before this call are stale then)."""
        if self.used + n <= MAX_LOAD * len(self.fps):
            return False
        live = self.values != 0
        fps, values = self.fps[live], self.values[live]
        need = (len(fps) + n) / (MAX_LOAD / 2)
        cap = MIN_CAPACITY
        while cap < need:
            cap *= 2
        self.fps = np.zeros(cap, dtype=np.uint64)
        self.values = np.zeros(cap, dtype=np.uint32)
        self.used = 0
        slots = self.insert(fps)
        self.values[slots] = values
        return True

    def insert(self, fps: np.ndarray) -> np.ndarray:
        """Add fingerprints that are absent and distinct (value 0); returns their
        slots. Call ``reserve(len(fps))`` first."""
        table = self.fps
        mask = len(table) - 1
        out = np.empty(len(fps), dtype=np.int64)
        idx = np.arange(len(fps))
        pos = (fps & np.uint64(mask)).astype(np.int64)
        want = fps
        while len(idx):
            free = table[pos] == EMPTY
            cand = np.flatnonzero(free)
            placed = np.zeros(len(idx), dtype=bool)
            if len(cand):
                # Several keys may claim one empty slot in a round: the write
                # that sticks wins, the others look again (and move on).
                table[pos[cand]] = want[cand]
                won = cand[table[pos[cand]] == want[cand]]
                out[idx[won]] = pos[won]
                placed[won] = True
            keep = ~placed
            step = np.where(free, 0, 1)[keep]
            idx, want = idx[keep], want[keep]
            pos = (pos[keep] + step) & mask
        self.used += len(fps)
        return out
