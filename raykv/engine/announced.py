"""What one engine process announced of the blocks it computes (``PendingBook``'s books).

Per pending key: when it was announced and released, its place in its request's
announcement (for the compute and prefill estimates), whether it is listed in the
directory, and what keeps it: stores of it in flight, and the process's live
requests that compute it, listed or not (``short``). Not thread-safe: the book
calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

#: Most announced blocks remembered (oldest forgotten first).
MAX_TIMED = 65_536


class Announced(NamedTuple):
    """What a book remembers of one block it announced."""

    announced: float  # when (the book's clock)
    place: int  # its place in its request's announcement (1-based)
    listed: bool  # listed in the directory (else only timed: ``short``)
    released: float  # when its request was released to compute it
    storing: int = 0  # stores of it handed to this process's tiers and not ended
    listers: int = 0  # live requests of this process that listed it and compute it
    timers: int = 0  # live requests of this process that compute it unlisted (``short``)


#: A block this process has not announced (yet): not listed, no store in flight.
_UNSEEN = Announced(0.0, 0, False, 0.0)


class AnnouncedBlocks(Mapping[bytes, Announced]):
    """Pending key -> what the process remembers of its announcement, at most ``MAX_TIMED``."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, Announced] = {}

    def __getitem__(self, pk: bytes) -> Announced:
        return self._blocks[pk]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, pks: Sequence[bytes], now: float, listed: bool) -> list[bytes]:
        """A request computes ``pks`` (in prefix order) from ``now``, ``listed`` or not.
        What another request listed or is storing stays. Returns the listed blocks
        forgotten past ``MAX_TIMED``: their entries should end, as no store will end them."""
        for i, pk in enumerate(pks, 1):  # (popped: a block announced again is among the newest)
            seen = self._blocks.pop(pk, _UNSEEN)
            self._blocks[pk] = Announced(
                now, i, listed or seen.listed, now, seen.storing, seen.listers + listed, seen.timers + (not listed)
            )
        forgotten: list[bytes] = []
        while len(self._blocks) > MAX_TIMED:
            oldest = next(iter(self._blocks))
            if self._blocks.pop(oldest).listed:
                forgotten.append(oldest)
        return forgotten

    def release(self, pks: Sequence[bytes], now: float) -> None:
        """Their request computes ``pks`` from ``now`` (its claim answered)."""
        for pk in pks:
            if (seen := self._blocks.get(pk)) is not None:
                self._blocks[pk] = seen._replace(released=now)

    def pop(self, pk: bytes) -> Announced | None:
        """Forget ``pk`` (stored), returning what was remembered of it (None: nothing)."""
        return self._blocks.pop(pk, None)

    def storing(self, pks: Sequence[bytes], change: int) -> None:
        """``change`` more (or fewer) stores of ``pks`` are in flight."""
        for pk in pks:
            if (seen := self._blocks.get(pk)) is not None:
                self._blocks[pk] = seen._replace(storing=max(0, seen.storing + change))

    def end(self, pks: Sequence[bytes], request: bool) -> list[bytes]:
        """A ``request`` that listed ``pks`` ended (not ``request``: a store of them failed).
        Returns the listed ones whose entries end: kept by no store in flight and no other
        lister. One that a request computing it unlisted still times is kept, unlisted."""
        gone: list[bytes] = []
        for pk in pks:
            if (seen := self._blocks.get(pk)) is None:
                continue
            seen = seen._replace(listers=max(0, seen.listers - request))
            if seen.storing or (request and seen.listers):
                self._blocks[pk] = seen
                continue
            if seen.timers:
                self._blocks[pk] = seen._replace(listed=False)
            else:
                del self._blocks[pk]
            if seen.listed:
                gone.append(pk)
        return gone

    def untime(self, pks: Sequence[bytes]) -> None:
        """A request that computed ``pks`` unlisted (``short``) ended: blocks no store in
        flight, other request or listing keeps are forgotten."""
        for pk in pks:
            if (seen := self._blocks.get(pk)) is None:
                continue
            seen = seen._replace(timers=max(0, seen.timers - 1))
            if seen.storing or seen.listers or seen.timers or seen.listed:
                self._blocks[pk] = seen
            else:
                del self._blocks[pk]
