"""``HolderSets``: interned sets of holder slots, so each directory entry
stores one small integer whatever its holders.

Keys of one shard share a handful of distinct holder sets (a node's plasma, a
shared root, both...), so a batch's transition (add or remove one holder) is
computed once per distinct set, and applied to the batch with numpy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class HolderSets:
    """Set id <-> frozenset of holder slots; id 0 is the empty set."""

    def __init__(self) -> None:
        self._sets: list[frozenset[int]] = [frozenset()]
        self._ids: dict[frozenset[int], int] = {frozenset(): 0}

    def __len__(self) -> int:
        return len(self._sets)

    def intern(self, slots: frozenset[int]) -> int:
        i = self._ids.get(slots)
        if i is None:
            i = self._ids[slots] = len(self._sets)
            self._sets.append(slots)
        return i

    def slots(self, set_id: int) -> frozenset[int]:
        return self._sets[set_id]

    def present(self, ids: np.ndarray) -> np.ndarray:
        """The distinct set ids in ``ids`` (O(len(ids) + number of sets))."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(np.bincount(ids, minlength=len(self._sets)))

    def containing(self, slot: int) -> np.ndarray:
        """Ids of every set that has ``slot``."""
        return np.array([i for i, s in enumerate(self._sets) if slot in s], dtype=np.uint32)

    def has(self, ids: np.ndarray, slot: int) -> np.ndarray:
        """Per id: whether its set has ``slot``."""
        lut = np.zeros(len(self._sets), dtype=bool)
        lut[self.containing(slot)] = True
        return lut[ids]

    def map(self, ids: np.ndarray, change: Callable[[frozenset[int]], frozenset[int]]) -> np.ndarray:
        """``ids`` with each set replaced by ``change(set)`` (computed once per distinct set)."""
        present = self.present(ids)
        new = [self.intern(change(self._sets[i])) for i in present]
        lut = np.arange(len(self._sets), dtype=np.uint32)
        lut[present] = new
        return lut[ids]

    def with_slot(self, ids: np.ndarray, slot: int) -> np.ndarray:
        return self.map(ids, lambda s: s | {slot})

    def without_slot(self, ids: np.ndarray, slot: int) -> np.ndarray:
        return self.map(ids, lambda s: s - {slot})
