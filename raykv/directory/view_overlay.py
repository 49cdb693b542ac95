"""``ViewOverlay``: what one engine process adds to its node's directory view.

The node's view (``raykv.directory.shm_view``) trails the shards by the
replica lag and knows nothing of this process in particular. The overlay
keeps, per process:

- its own stores, added to the view's answers until the view shows them
  (read-your-writes: the feed lags a store by a few ms);
- keys it does not trust the view for after a failed load (``distrust``),
  asked of the directory again for a while;
- the answers for a request's prefix read in one go (``read_prefix``), which
  serve the step's other lookups of those keys as a dict read.

Plain Python, not thread-safe: ``LookupCache`` calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from raykv.core.wire import HolderInfo
from raykv.directory.shm_view import ViewReader

#: Why a prefix read left keys to ask the agent for: the view's read was given up
#: (``ViewReader.gave_up``'s reasons), its read held but it does not know them (a
#: view of asked keys, or one still filling), it lists them under a holder set its
#: holder table lacks, or a failed load made them distrusted here.
UNANSWERED = ("busy", "stale", "remap", "decode", "no view", "not known", "no holder set", "distrusted")


class ViewOverlay:
    """One process's corrections to the node's view (see the module docstring)."""

    #: How long a prefix read from the view in one go serves the step's other lookups.
    RECENT_S = 0.02

    def __init__(self, view: ViewReader, ttl_s: float, max_entries: int) -> None:
        self.view = view
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        #: Distrusted keys: until when, and the tier type invalidated (None: all).
        self._distrust: OrderedDict[bytes, tuple[float, str | None]] = OrderedDict()
        #: Our own stores: until when, and the holders.
        self._own: OrderedDict[bytes, tuple[float, list[HolderInfo]]] = OrderedDict()
        self._recent: dict[bytes, list[HolderInfo]] = {}
        self._recent_at = 0.0
        #: Why the last ``read_prefix`` left keys unanswered (None: it answered them all).
        self.unanswered: str | None = None

    def get(self, key: bytes) -> list[HolderInfo] | None:
        """The view's answer for ``key`` with our own stores added; None when the
        view does not know it, or when it is distrusted."""
        if self._distrust and self.distrusted(key) is not None:
            return None
        holders = None
        if self._recent and time.monotonic() - self._recent_at <= self.RECENT_S:
            holders = self._recent.get(key)
        if holders is None:
            holders = self.view.get(key)
        if holders is None:
            return None
        return self._with_own(key, holders) if self._own else holders

    def read_prefix(self, keys: Sequence[bytes]) -> dict[bytes, list[HolderInfo]]:
        """The view's answers for the trusted ones of ``keys``, read in one go; kept
        for ``RECENT_S`` for the step's other lookups. Where some key is left
        unanswered, ``unanswered`` says why."""
        trusted = [k for k in keys if not self._distrust or self.distrusted(k) is None]
        known = self.view.lookup(trusted)
        now = time.monotonic()
        if now - self._recent_at > self.RECENT_S:
            self._recent = {}
            self._recent_at = now
        answered = {k: h for k, h in zip(trusted, known) if h is not None}
        self._recent.update(answered)
        self.unanswered = None
        if len(answered) < len(keys):
            self.unanswered = self._why_unanswered(len(answered) < len(trusted))
        return answered

    def _why_unanswered(self, in_view: bool) -> str:
        """Why the last ``read_prefix`` left keys unanswered (``UNANSWERED``): ``in_view``,
        some trusted key was not answered by the view; otherwise only distrusted ones."""
        if not in_view:
            return "distrusted"
        if self.view.unread is not None:
            return self.view.unread  # the read was given up (``ViewReader.gave_up``)
        return "no holder set" if self.view.complete else "not known"

    def distrusted(self, key: bytes) -> tuple[float, str | None] | None:
        """Whether (and for which tier type) ``key``'s view answer is not trusted now."""
        entry = self._distrust.get(key)
        if entry is not None and time.monotonic() > entry[0]:
            del self._distrust[key]
            return None
        return entry

    def _with_own(self, key: bytes, holders: list[HolderInfo]) -> list[HolderInfo]:
        """``holders`` plus our own recent stores of ``key`` the view does not show yet."""
        own = self._own.get(key)
        if own is None:
            return holders
        if time.monotonic() > own[0]:
            del self._own[key]
            return holders
        extra = [h for h in own[1] if h not in holders]
        return holders + extra if extra else holders

    def note_stored(self, keys: Sequence[bytes], holder: HolderInfo) -> None:
        """``holder`` now holds ``keys`` (our stores): read back until the view shows them."""
        until = time.monotonic() + self.ttl_s
        for k in keys:
            old = self._own.get(k)
            held = old[1] if old is not None and holder in old[1] else [*(old[1] if old else ()), holder]
            self._own[k] = (until, held)
            self._own.move_to_end(k)
        while len(self._own) > self.max_entries:
            self._own.popitem(last=False)

    def distrust(self, keys: Sequence[bytes], tier_type: str | None) -> None:
        """A failed load says the view may be wrong for ``keys`` (their ``tier_type``
        holders, or all): not trusted for ``ttl_s``, and our own stores of them forgotten."""
        until = time.monotonic() + self.ttl_s
        for k in keys:
            self._distrust[k] = (until, tier_type)
            self._distrust.move_to_end(k)
            own = self._own.pop(k, None)
            if own is not None and tier_type is not None:
                rest = [h for h in own[1] if h.tier_type != tier_type]
                if rest:
                    self._own[k] = (own[0], rest)
        while len(self._distrust) > self.max_entries:
            self._distrust.popitem(last=False)
