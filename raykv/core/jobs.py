"""Job bookkeeping shared by tiers: exactly one ``JobResult`` per submitted job."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Collection
from typing import Protocol

from raykv.core.contract import JobResult, TransferJob
from raykv.core.keys import OffloadKey
from raykv.core.logs import Throttled

logger = logging.getLogger(__name__)


class JobTracker:
    """Thread-safe registry of in-flight jobs and their finished results.

    ``begin`` a job when it is submitted; ``finish`` it exactly once from
    whatever thread completes it. A second ``finish`` for the same job is
    dropped (and logged), so a tier can never report a job twice.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, TransferJob] = {}
        self._done: deque[JobResult] = deque()

    def begin(self, job: TransferJob) -> None:
        with self._cond:
            if job.job_id in self._pending:
                raise ValueError(f"job {job.job_id} is already in flight")
            self._pending[job.job_id] = job

    def finish(self, result: JobResult) -> bool:
        """Queue ``result``; False if its job was not in flight (dropped)."""
        with self._cond:
            job = self._pending.pop(result.job_id, None)
            if job is None:
                logger.warning("dropping second result for job %s", result.job_id)
                return False
            if result.transfer_time is None:
                result.transfer_time = time.monotonic() - job.submit_time
            self._done.append(result)
            self._cond.notify_all()
            return True

    def succeed(self, job: TransferJob, transfer_bytes: int | None = None) -> bool:
        return self.finish(JobResult(job.job_id, True, transfer_bytes=transfer_bytes))

    def fail(
        self,
        job: TransferJob,
        error: str,
        successful_keys: Collection[OffloadKey] | None = None,
        deferred_release: threading.Event | None = None,
    ) -> bool:
        keys = None if successful_keys is None else list(successful_keys)
        result = JobResult(job.job_id, False, successful_keys=keys, error=error, deferred_release=deferred_release)
        return self.finish(result)

    def take(self) -> list[JobResult]:
        """Pop every finished result."""
        with self._cond:
            out = list(self._done)
            self._done.clear()
            return out

    def pending(self) -> list[TransferJob]:
        with self._cond:
            return list(self._pending.values())

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)


#: Bounded labels for why a job failed (a metrics tag), first match wins.
class JobAccounting(Protocol):
    """Where a ``MeteredJobTracker`` accounts finished jobs."""

    def job_finished(self, job: TransferJob, result: JobResult, block_bytes: int) -> None: ...


class MeteredJobTracker(JobTracker):
    """A ``JobTracker`` that accounts every finished job in ``metrics`` (a ``raykv.metrics.recorders.TierMetrics``)."""

    def __init__(self, metrics: JobAccounting, block_bytes: int) -> None:
        super().__init__()
        self.metrics = metrics
        self.block_bytes = block_bytes

    def finish(self, result: JobResult) -> bool:
        with self._cond:  # a re-entrant lock: the job is still pending here
            job = self._pending.get(result.job_id)
            accepted = super().finish(result)
        if accepted and job is not None:
            self.metrics.job_finished(job, result, self.block_bytes)
        return accepted


_REASONS = (
    ("timed out", "timeout"),
    ("drain timeout", "timeout"),
    ("unavailable", "holder_unavailable"),
    ("not committed", "holder_unavailable"),
    ("shut down", "shut_down"),
    ("object store is full", "full"),
    ("no space", "full"),
    ("enospc", "full"),
    ("corrupt", "corrupt"),
    ("checksum", "corrupt"),
    ("not held", "not_held"),
    ("missing", "not_held"),
    ("not loaded", "not_held"),
    ("not submitted", "bad_job"),
    ("cannot submit", "bad_job"),
    ("offload key", "bad_job"),
    ("chunk id", "bad_job"),
)


def failure_reason(error: str | None) -> str:
    """A short, bounded label for a job's error text (``other`` when unknown)."""
    text = (error or "").lower()
    for needle, reason in _REASONS:
        if needle in text:
            return reason
    return "other"


class FailureLog:
    """Logs failed jobs' reasons, at most once per ``period_s`` per reason,
    with how many were not logged in between (failures can come every step)."""

    def __init__(self, what: str, period_s: float = 10.0) -> None:
        self.what = what
        self._throttled = Throttled(logger, period_s)

    def note(self, kind: str, reason: str, error: str | None) -> bool:
        """Record one failure; True when it was logged."""
        return self._throttled.warning("%s %s job failed [%s]: %s", self.what, kind, reason, error, key=reason)
