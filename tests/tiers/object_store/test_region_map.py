"""The object store actor's map of engines' primary regions, without Ray:
reuse, LRU unmapping and unmapping regions whose engine closed them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raykv.engine.primary import MappedRegion, PrimaryRegion, RegionHandle, describe_region
from tiers.object_store.regions import RegionMap


class Opener:
    """``MappedRegion``, counting opens and closes."""

    def __init__(self) -> None:
        self.opened: list[RegionHandle] = []
        self.closed: list[RegionHandle] = []

    def __call__(self, handle: RegionHandle) -> MappedRegion:
        self.opened.append(handle)
        mapped = MappedRegion(handle)
        close = mapped.close

        def closing() -> None:
            self.closed.append(handle)
            close()

        mapped.close = closing  # type: ignore[method-assign]
        return mapped


@pytest.fixture
def primaries():
    made: list[PrimaryRegion] = []

    def make(n: int = 4, bpc: int = 4096) -> tuple[PrimaryRegion, RegionHandle]:
        region = PrimaryRegion(n, bpc)
        made.append(region)
        return region, describe_region(region.view)

    yield make
    for region in made:
        region.close()


def test_a_region_is_mapped_once_and_shares_the_engines_bytes(primaries):
    opener = Opener()
    regions = RegionMap("node-1", open_region=opener)
    primary, handle = primaries()
    array = regions.array(handle)
    assert array.shape == (4, 4096)
    primary.array[2] = 7  # the engine writes; the actor's mapping sees it (and the other way round)
    assert np.all(array[2] == 7)
    array[1] = 9
    assert np.all(primary.array[1] == 9)
    assert regions.array(dataclasses.replace(handle, node_id="node-1")) is not None
    assert len(opener.opened) == 1 and len(regions) == 1


def test_least_recently_used_regions_are_unmapped_beyond_the_limit(primaries):
    opener = Opener()
    regions = RegionMap("node-1", max_regions=2, open_region=opener)
    handles = [primaries()[1] for _ in range(3)]
    regions.array(handles[0])
    regions.array(handles[1])
    regions.array(handles[0])  # 1 is now the least recently used
    regions.array(handles[2])
    assert opener.closed == [handles[1]] and len(regions) == 2
    regions.array(handles[0])  # still mapped, and now used after 2
    assert len(opener.opened) == 3
    regions.array(handles[1])  # mapped again: 2 is the least recently used now
    assert opener.closed == [handles[1], handles[2]] and len(opener.opened) == 4


def test_regions_whose_engine_closed_them_are_unmapped(primaries):
    opener = Opener()
    now = [100.0]
    regions = RegionMap("node-1", open_region=opener, clock=lambda: now[0])
    first, h1 = primaries()
    _, h2 = primaries()
    regions.array(h1)
    regions.array(h2)
    first.close()  # the engine is gone: /proc/<pid>/fd/<n> no longer exists
    assert regions.sweep() == 0  # checked at most once a second
    now[0] += 1.5
    assert regions.sweep() == 1 and opener.closed == [h1] and len(regions) == 1
    with pytest.raises(OSError):
        regions.array(h1)


def test_another_nodes_region_is_refused(primaries):
    regions = RegionMap("node-1", open_region=Opener())
    _, handle = primaries()
    with pytest.raises(ValueError, match="node-2 cannot be mapped on node node-1"):
        regions.array(dataclasses.replace(handle, node_id="node-2"))
    assert len(regions) == 0
