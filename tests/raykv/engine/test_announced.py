"""An engine process's books of the blocks it announced (``AnnouncedBlocks``): what keeps a block, what ends it."""

from __future__ import annotations

import pytest

from raykv.engine.announced import AnnouncedBlocks

A, B, C = b"a", b"b", b"c"


def test_the_oldest_blocks_are_forgotten_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only listed ones are returned: their entries must end, as no store will end them now."""
    monkeypatch.setattr("raykv.engine.announced.MAX_TIMED", 2)
    blocks = AnnouncedBlocks()
    assert blocks.add([A], 1.0, listed=True) == []
    assert blocks.add([B], 2.0, listed=False) == []
    assert blocks.add([C], 3.0, listed=False) == [A]
    assert list(blocks) == [B, C]
    assert blocks.add([A], 4.0, listed=True) == []  # B was only timed: nothing to end
    assert list(blocks) == [C, A]
    blocks.add([C], 5.0, listed=False)  # announced again: C is now the newest
    assert blocks.add([B], 6.0, listed=False) == [A] and list(blocks) == [C, B]


def test_a_block_is_kept_by_its_stores_and_its_live_requests() -> None:
    blocks = AnnouncedBlocks()
    blocks.add([A, B], 1.0, listed=True)
    assert blocks[B].place == 2 and blocks[A].listers == 1
    blocks.add([A], 2.0, listed=False)  # a second request computes A unlisted: A stays listed
    assert blocks[A].listed and blocks[A].timers == 1 and blocks[A].announced == 2.0
    blocks.storing([B], 1)
    assert blocks.end([A, B], request=True) == [A]  # B's store is in flight
    assert not blocks[A].listed  # the listing ended; the unlisted request still times it
    blocks.untime([A])
    assert A not in blocks and B in blocks
    blocks.storing([B], -1)
    assert blocks.end([B], request=False) == [B] and not blocks
    blocks.add([C], 3.0, listed=False)
    blocks.release([C], 3.5)
    assert blocks[C].released == 3.5 and blocks.pop(C) is not None and blocks.pop(C) is None
