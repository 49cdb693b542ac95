"""``ChangeFeed``: what changed in a directory shard, in order, for its readers.

Node agents (``raykv.directory.agent``) keep views of the directory that must
follow every change, not expire by a TTL. A shard appends one entry per
change (a holder announced or dropped, a batch of keys registered or
unregistered), numbered in order; a reader asks for the entries after the last
one it applied. The feed keeps a bounded tail (``MAX_FEED_AGE_S`` seconds, at
most ``MAX_FEED_KEYS`` keys): a reader that fell further behind, or that read
an earlier life of the shard (``epoch``), gets a gap and starts over from a
snapshot. Plain Python, no Ray.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable

from raykv.core.wire import HolderInfo
from raykv.directory.messages import FeedEntry, FeedOp, FeedPage

#: Most fingerprints the feed keeps: past it, the oldest entries go. An entry costs
#: ~210 bytes of Python objects (~85 per key at the soak's 2.5 keys per entry), so
#: this caps a burst's tail near 40 MiB per shard.
MAX_FEED_KEYS = 500_000
#: Oldest entry the feed keeps, in seconds. Readers follow within a second (node
#: agents ask every ~0.1 s when busy; a quiet one's long poll is answered at once on
#: a change); one further behind starts over from a snapshot. Without it a steadily
#: churning shard kept every change up to ``MAX_FEED_KEYS`` (the hour-long memory soak: +90 MiB per shard in an hour).
MAX_FEED_AGE_S = 60.0
#: Most entries one page carries (a reader asks again for the rest).
PAGE_ENTRIES = 4096


class ChangeFeed:
    """Numbered entries of one shard's changes; entry ``seq`` n is the n-th change."""

    def __init__(
        self, max_keys: int = MAX_FEED_KEYS, max_age_s: float = MAX_FEED_AGE_S, clock: Callable[[], float] = time.time
    ) -> None:
        #: Tells this life of the shard from an earlier one (sequence numbers restart).
        self.epoch = int.from_bytes(os.urandom(8), "little")
        self.max_keys = max_keys
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: deque[FeedEntry] = deque()
        self._keys = 0
        self.seq = 0  # the last entry's number (0: none yet)

    @property
    def first_seq(self) -> int:
        """The oldest entry still kept (``seq + 1`` when none is)."""
        return self._entries[0].seq if self._entries else self.seq + 1

    def append(self, op: FeedOp, holder_id: str, fps: bytes = b"", info: HolderInfo | None = None) -> None:
        self.seq += 1
        now = self._clock()
        self._entries.append(FeedEntry(self.seq, op, holder_id, fps, info, now))
        self._keys += len(fps) // 8
        oldest = now - self.max_age_s
        entries = self._entries
        while len(entries) > 1 and (self._keys > self.max_keys or entries[0].at < oldest):
            self._keys -= len(entries.popleft().fps) // 8

    def page(self, epoch: int, since: int, holders: list[HolderInfo]) -> FeedPage:
        """The entries after ``since`` for a reader of ``epoch``; a gap (with
        ``holders``, the shard's holders now) when this feed no longer has them."""
        if epoch != self.epoch or since < self.first_seq - 1 or since > self.seq:
            return FeedPage(self.epoch, self.seq, (), gap=True, holders=tuple(holders))
        skip = since - (self.first_seq - 1)
        entries = tuple(itertools.islice(self._entries, skip, skip + PAGE_ENTRIES))
        return FeedPage(self.epoch, entries[-1].seq if entries else self.seq, entries)

    def has_after(self, since: int) -> bool:
        return self.seq > since
