"""Holder-side log of blocks stored and removed, read by engines as KV events.

Each holder actor (an object store node actor, an fs root actor) appends one
entry per batch of keys it takes in or lets go. Engines read the log from a
sequence number on, filtered to their identity's tag (``raykv.core.identity``), and
turn it into vLLM ``OffloadingEvent``s (``take_events``), so vLLM's KV-event
consumers (routers) see what raykv holds. The log is a bounded ring: a reader
that fell behind past its start gets a snapshot of the current holdings instead.

It keeps entries only while someone reads it: with no read for
``READER_IDLE_S`` it drops what it holds and counts sequence numbers alone,
so a holder whose engines have KV events off carries no history (a full ring
is ~85 MB of key objects per actor: the memory soak saw the object-store
actor grow 58 MB in 5 minutes of churn). A reader that comes (back) gets a
snapshot first, as any reader that fell behind does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from raykv.core.identity import TAG_BYTES
from raykv.core.wire import HoldingsPage

#: Keys kept in the ring before the oldest entries go.
DEFAULT_MAX_KEYS = 1 << 20
#: With no read for this long, the log keeps no entries (readers poll every
#: engine step while they read; a minute covers a restarting engine).
READER_IDLE_S = 60.0


class HoldingsLog:
    """A bounded, sequence-numbered log of ``(removed, keys)`` batches, kept while read."""

    def __init__(
        self,
        max_keys: int = DEFAULT_MAX_KEYS,
        reader_idle_s: float = READER_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_keys = max_keys
        self.reader_idle_s = reader_idle_s
        self._clock = clock
        self._last_read: float | None = None  # no reader yet
        self._entries: deque[tuple[int, bool, list[bytes]]] = deque()
        self._keys = 0
        self.next_seq = 0

    @property
    def num_keys(self) -> int:
        """Keys held in the ring now."""
        return self._keys

    def append(self, removed: bool, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        if not keys:
            return
        if self._last_read is None or self._clock() - self._last_read > self.reader_idle_s:
            # Nobody reads: keep nothing; a reader that comes gets a snapshot.
            self._entries.clear()
            self._keys = 0
            self.next_seq += 1
            return
        self._entries.append((self.next_seq, removed, keys))
        self.next_seq += 1
        self._keys += len(keys)
        while self._keys > self.max_keys and len(self._entries) > 1:
            self._keys -= len(self._entries.popleft()[2])

    def read(self, since: int | None, tag: bytes, holdings: Callable[[], Sequence[bytes]]) -> HoldingsPage:
        """Entries from ``since`` on whose keys start with ``tag`` (keys unchanged,
        still scoped). ``since=None``, or a ``since`` the ring no longer holds:
        a ``snapshot`` of every held key of ``tag`` instead."""
        self._last_read = self._clock()
        first = self._entries[0][0] if self._entries else self.next_seq
        if since is None or since < first or since > self.next_seq:
            keys = [k for k in holdings() if k[:TAG_BYTES] == tag]
            return HoldingsPage(next=self.next_seq, snapshot=keys, events=[])
        events: list[tuple[bool, list[bytes]]] = []
        for seq, removed, keys in self._entries:
            if seq < since:
                continue
            mine = [k for k in keys if k[:TAG_BYTES] == tag]
            if mine:
                events.append((removed, mine))
        return HoldingsPage(next=self.next_seq, snapshot=None, events=events)
