"""``RoundTrips``: how long one engine process's directory lookups take, and how long to wait for the next."""

from __future__ import annotations

import time


class RoundTrips:
    """The smoothed round trip of the lookups this process waited for; ``wait_budget``
    waits only while they fit in the wait."""

    #: While round trips are slower than the wait, still wait once per this many
    #: seconds, to notice that the directory got fast again.
    PROBE_EVERY_S = 1.0

    def __init__(self) -> None:
        #: Smoothed round trip (seconds; None: none yet).
        self.rtt_s: float | None = None
        self._last_probe = 0.0

    def wait_budget(self, wait_s: float) -> float:
        """How long a lookup may wait for the directory: ``wait_s`` while recent
        round trips fit in it, else 0 (a wait that would time out anyway only
        delays the step), except one probe per ``PROBE_EVERY_S``."""
        if wait_s <= 0 or self.rtt_s is None or self.rtt_s <= wait_s:
            return max(wait_s, 0.0)
        now = time.monotonic()
        if now - self._last_probe >= self.PROBE_EVERY_S:
            self._last_probe = now
            return wait_s
        return 0.0

    def observe(self, seconds: float) -> None:
        """One more round trip measured."""
        self.rtt_s = seconds if self.rtt_s is None else 0.7 * self.rtt_s + 0.3 * seconds
