"""Every fs job ends by its deadline, whatever its storage does.

Shared storage can stop answering: an NFS server gone with the mount hard, a bucket
behind a dead network. An I/O thread then blocks in ``open`` or ``read`` for as long as
it does, and without a deadline so would the job, and the vLLM request waiting on its
load. ``Deadlines`` keeps the engine's jobs in flight; once one is past
``job_timeout_s`` it is expired (``BlockJob.expire``): its blocks not done fail, and
the job ends with a failed result at once.

vLLM reuses a failed job's primary slots, so a thread that returns late must not touch
them: I/O goes through a staging buffer of the thread's own, copied to or from the slot
only while the job lives (``BlockJob.with_slots``). A late load's bytes go nowhere; a
late store writes what the slot held while the job lived. Once every I/O thread is late
(a hung mount blocks them all within one job) the tier is ``stalled``: it loads nothing
and fails new jobs at once (misses, not waits) until a thread returns. A thread or two
late on a file of their own (one bad file) leave the others at work.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from raykv.core.logs import Throttled
from tiers.fs.jobs import BlockJob

logger = logging.getLogger(__name__)
_expired = Throttled(logger)


class Deadlines:
    """An fs tier's jobs in flight, in deadline order, and its I/O threads running late."""

    def __init__(self, timeout_s: float, where: str, block_bytes: int, threads: int) -> None:
        self.timeout_s = timeout_s
        self.threads = threads
        self.where = where
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._live: dict[int, tuple[BlockJob, bool]] = {}  # id(state) -> (state, store), oldest first
        self._late = 0
        self._local = threading.local()

    def deadline(self) -> float:
        """The deadline of a job submitted now (``time.monotonic()``)."""
        return time.monotonic() + self.timeout_s

    def add(self, state: BlockJob, store: bool) -> None:
        with self._lock:
            self._live[id(state)] = (state, store)

    def ended(self, state: BlockJob) -> None:
        """``state`` ended on its own (its last block done)."""
        with self._lock:
            self._live.pop(id(state), None)

    def overdue(self) -> list[tuple[BlockJob, bool]]:
        """Expire the jobs past their deadline; returns those that were still running,
        each with whether it is a store (the caller ends each)."""
        now = time.monotonic()
        with self._lock:
            due = []
            for key, (state, _) in self._live.items():
                if state.deadline > now:
                    break  # later ones were submitted later: their deadlines are later too
                due.append(key)
            jobs = [self._live.pop(key) for key in due]
        out = []
        for state, store in jobs:
            late = state.expire(f"timed out: no answer from the storage within job_timeout_s={self.timeout_s:g}s")
            if late is None:
                continue  # its last block was done meanwhile: it ends on its own
            with self._lock:
                self._late += late
            _expired.warning(
                "raykv fs tier %s: a %s job had no answer from the storage within job_timeout_s=%gs "
                "(%d of %d I/O threads waiting: a hung mount?); the job fails, and while all of them wait "
                "this engine loads nothing from the root and fails new jobs at once",
                self.where,
                "store" if store else "load",
                self.timeout_s,
                self._late,
                self.threads,
                key=f"expired {self.where}",
            )
            out.append((state, store))
        return out

    def returned_late(self) -> None:
        """An I/O call of an expired job returned."""
        with self._lock:
            was = self.stalled
            self._late -= 1
            now = self.stalled
        if was and not now:
            logger.warning("raykv fs tier %s: the storage answers again; the tier loads and stores again", self.where)

    @property
    def late(self) -> int:
        """I/O calls of expired jobs still waiting (0: the storage answers)."""
        return self._late

    @property
    def stalled(self) -> bool:
        """Whether every I/O thread waits on a call of an expired job: no I/O can run now."""
        return self._late >= self.threads

    def check(self) -> None:
        """Raise while the tier stalls: a new job then fails at once, not at its deadline."""
        if self.stalled:
            raise RuntimeError(f"storage unavailable: all {self._late} I/O threads wait past job_timeout_s")

    def staging(self) -> np.ndarray:
        """This I/O thread's buffer of one block (block I/O goes through it, never straight
        to a primary slot: a thread that returns after the deadline touches no slot)."""
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.empty(self.block_bytes, dtype=np.uint8)
        return buf
