"""``RegionMap``: the engines' primary regions that a node's actor has mapped.

An engine's store or load names its primary region by ``RegionHandle`` (a
``/dev/shm`` file); the actor maps it once and reuses the mapping for later
jobs of that engine. The most recently used ``max_regions`` stay mapped, and
a region whose file is gone (its engine closed it) is unmapped, so
``/dev/shm`` frees it.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import numpy as np

from raykv.engine.primary import MappedRegion, RegionHandle

#: Mapped regions kept at most (least recently used are unmapped first).
MAX_MAPPED_REGIONS = 32
#: Least seconds between two checks for regions whose file is gone.
SWEEP_EVERY_S = 1.0

#: (path, offset, num_chunks, bytes_per_chunk, device, inode): one mapping.
RegionId = tuple[str, int, int, int, int, int]


class RegionMapping(Protocol):
    """A mapped region (``MappedRegion``)."""

    array: np.ndarray

    def close(self) -> None: ...


class RegionMap:
    """Mapped primary regions of one node, in LRU order."""

    def __init__(
        self,
        node_id: str,
        max_regions: int = MAX_MAPPED_REGIONS,
        open_region: Callable[[RegionHandle], RegionMapping] = MappedRegion,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.max_regions = max_regions
        self._open = open_region
        self._clock = clock
        self._regions: OrderedDict[RegionId, RegionMapping] = OrderedDict()
        self._last_sweep = float("-inf")

    def __len__(self) -> int:
        return len(self._regions)

    def array(self, handle: RegionHandle) -> np.ndarray:
        """The ``(num_chunks, bytes_per_chunk)`` array of an engine's primary region.

        ``ValueError`` for another node's region, ``OSError`` when its file
        cannot be mapped."""
        if handle.node_id is not None and handle.node_id != self.node_id:
            raise ValueError(f"primary region of node {handle.node_id} cannot be mapped on node {self.node_id}")
        st = os.stat(handle.path)
        ident = (handle.path, handle.offset, handle.num_chunks, handle.bytes_per_chunk, st.st_dev, st.st_ino)
        mapped = self._regions.get(ident)
        if mapped is not None:
            self._regions.move_to_end(ident)
            self.sweep()
            return mapped.array
        self.sweep(force=True)
        mapped = self._open(handle)
        self._regions[ident] = mapped
        while len(self._regions) > self.max_regions:
            _, old = self._regions.popitem(last=False)
            old.close()
        return mapped.array

    def sweep(self, force: bool = False) -> int:
        """Unmap regions whose file is gone or replaced (at most once per
        ``SWEEP_EVERY_S`` unless ``force``); returns how many."""
        now = self._clock()
        if not force and now - self._last_sweep < SWEEP_EVERY_S:
            return 0
        self._last_sweep = now
        gone = [ident for ident in self._regions if not _same_file(ident)]
        for ident in gone:
            self._regions.pop(ident).close()
        return len(gone)


def _same_file(ident: RegionId) -> bool:
    path, *_, dev, ino = ident
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)
