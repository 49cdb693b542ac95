"""The primary region: a shared-memory file another process on the node maps by handle."""

from __future__ import annotations

import os

import numpy as np
import pytest

from raykv.engine.primary import MappedRegion, PrimaryRegion, describe_region


def test_region_is_unlinked_and_mappable_by_handle() -> None:
    with PrimaryRegion(4, 8192) as region:
        assert not os.path.exists(region.path), "the file name must not outlive set-up"
        handle = describe_region(region.view)
        assert (handle.num_chunks, handle.bytes_per_chunk, handle.nbytes) == (4, 8192, 4 * 8192)
        region.array[2] = 7
        other = MappedRegion(handle)  # what a tier actor does
        try:
            assert (other.array[2] == 7).all() and not other.array[1].any()
            other.array[3] = 9  # writes go both ways: it is the same memory
            assert (region.array[3] == 9).all()
        finally:
            other.close()


def test_describe_region_refuses_plain_memory_and_bad_shapes() -> None:
    plain = memoryview(np.zeros((4, 64), dtype=np.uint8))
    with pytest.raises(ValueError, match="not backed by a shared-memory file"):
        describe_region(plain)
    with PrimaryRegion(2, 64) as region, pytest.raises(ValueError, match="2-D"):
        describe_region(region.view.cast("B"))


def test_bad_sizes_are_refused() -> None:
    for chunks, size in [(0, 64), (4, 0), (-1, 64)]:
        with pytest.raises(ValueError, match="must be > 0"):
            PrimaryRegion(chunks, size)
