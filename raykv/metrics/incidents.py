"""Removed block files, each counted and named in the log (``RemovalLog``).

A tier that removes a corrupt, unreadable or missing block file says so: the
removal counts in ``raykv_tier_removed_files`` (label ``reason``), and the log
names the file's key and path. The first removals of a reason in a period are
logged one record per file, at once; the ones that follow within the period
are gathered and logged when it ends, as one summary per reason naming every
file ("7 corrupt files removed in the last 10 s: ..."). The log stays bounded
under a storm of removals and no removal goes unnamed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raykv.metrics.catalog import record

logger = logging.getLogger("raykv.metrics.incidents")


@dataclass(frozen=True)
class Removal:
    """One removed file: its key (hex), its path, and what was wrong with it."""

    key: str
    path: str
    detail: str = ""

    def text(self) -> str:
        return f"key {self.key} at {self.path}" + (f" ({self.detail})" if self.detail else "")


class RemovalLog:
    """Counts (metric, by reason) and logs every removed file of one holder.

    ``what`` opens each line ("fs root /data/kv"); ``tags`` are the metric's
    tier/node/holder tags. Up to ``burst`` files per reason and period are
    logged at once, one record each; later files wait for the period's end
    and go out in summaries of at most ``per_summary`` files (every file
    named). Thread-safe; the period's end is a daemon timer.
    """

    def __init__(
        self,
        what: str,
        tags: Mapping[str, str],
        period_s: float = 10.0,
        burst: int = 10,
        per_summary: int = 100,
    ) -> None:
        self.what = what
        self.tags = dict(tags)
        self.period_s = period_s
        self.burst = burst
        self.per_summary = per_summary
        self._lock = threading.Lock()
        self._window: dict[str, tuple[float, int]] = {}  # reason -> (window start, files logged at once)
        self._pending: dict[str, list[Removal]] = {}
        self._timer: threading.Timer | None = None
        #: Every file counted, by reason (tools, tests, stats).
        self.totals: dict[str, int] = {}

    def note(self, reason: str, removals: Sequence[Removal]) -> None:
        """Count and log ``removals`` (files removed for ``reason``)."""
        if not removals:
            return
        record("raykv_tier_removed_files", len(removals), {**self.tags, "reason": reason})
        now = time.monotonic()
        with self._lock:
            self.totals[reason] = self.totals.get(reason, 0) + len(removals)
            start, logged = self._window.get(reason, (-1e18, 0))
            if now - start >= self.period_s:
                start, logged = now, 0
            at_once = list(removals[: max(0, self.burst - logged)])
            later = list(removals[len(at_once) :])
            self._window[reason] = (start, logged + len(at_once))
            if later:
                self._pending.setdefault(reason, []).extend(later)
                self._arm(start + self.period_s - now)
        for r in at_once:
            logger.warning("%s: removed %s block file %s", self.what, reason, r.text())

    def _arm(self, delay: float) -> None:
        if self._timer is None:
            self._timer = threading.Timer(max(0.0, delay), self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Log the gathered removals now, one summary per reason (also what the timer calls)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._timer = None
            now = time.monotonic()
            for reason in pending:  # the summary opens the next window
                self._window[reason] = (now, self.burst)
            if pending:
                self._arm(self.period_s)  # removals until then are gathered again
        for reason, removals in pending.items():
            n = len(removals)
            for i in range(0, n, self.per_summary):
                part = removals[i : i + self.per_summary]
                where = f" [{i + 1}-{i + len(part)} of {n}]" if n > self.per_summary else ""
                logger.warning(
                    "%s: %d %s block files removed in the last %.0f s%s: %s",
                    self.what,
                    n,
                    reason,
                    self.period_s,
                    where,
                    "; ".join(r.text() for r in part),
                )

    def close(self) -> None:
        """Log what is gathered and stop the timer."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.flush()
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
