"""A small blocking client over any tier: store / load by keys and primary slots.

This is what non-vLLM engines, tools, benchmarks and tests use; the engine
path itself (vLLM) drives tiers step by step without ever blocking.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from time import perf_counter_ns as _now

import numpy as np

from raykv.core.contract import JobResult, LookupResult, ReqContext, SecondaryTier, TransferJob
from raykv.core.keys import OffloadKey, validate_keys
from raykv.core.validate import ArgumentError, int_sequence_arg, timeout_arg
from raykv.metrics.step_cost import StepCost

_job_ids = itertools.count(1_000_000)
_cost: StepCost | None = None


def driver_step_cost() -> StepCost:
    """The step meter of this process's ``TierDriver``s (``raykv.metrics.step_cost``):
    each round of a driver's wait is one step of the engine it stands for, each
    ``lookup`` call one request."""
    global _cost
    if _cost is None:
        _cost = StepCost()
    return _cost


class TierDriver:
    """Runs one job at a time on ``tier`` and waits for its result.

    It measures its calls into the tier as an engine's would be
    (``driver_step_cost``), exported to Ray's metrics as each call ends."""

    def __init__(self, tier: SecondaryTier, req_id: str = "raykv-client") -> None:
        self.tier = tier
        self.req = ReqContext(req_id)
        self._stash: dict[int, JobResult] = {}
        self.cost = driver_step_cost()

    def _step(self) -> None:
        """One engine step's end: the tier's ``on_schedule_end``, then the meter's."""
        t0 = _now()
        try:
            self.tier.on_schedule_end()
        finally:
            self.cost.ns += _now() - t0
            self.cost.step_end()

    def wait(self, job_id: int, timeout: float) -> JobResult:
        """The result of job ``job_id`` (submitted through this driver or
        straight to the tier), stepping the tier until it comes;
        ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                t0 = _now()
                try:
                    for r in self.tier.get_finished_jobs():
                        self._stash[r.job_id] = r
                finally:
                    self.cost.ns += _now() - t0
                if job_id in self._stash:
                    return self._stash.pop(job_id)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} did not finish within {timeout}s")
                self._step()
                time.sleep(0.0005)
        finally:
            self.cost.export()

    def _job(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], promotion: bool) -> TransferJob:
        """A job for ``keys`` -> primary slots ``chunk_ids`` (ints in range; never coerced)."""
        valid = validate_keys(keys)
        chunks = int_sequence_arg("chunk_ids", chunk_ids, minimum=0)
        if len(valid) != len(chunks):
            raise ArgumentError("chunk_ids", f"{len(valid)} keys but {len(chunks)} chunk ids")
        num_chunks = getattr(self.tier, "num_chunks", None)
        for i, c in enumerate(chunks):
            if num_chunks is not None and c >= num_chunks:
                raise ArgumentError(f"chunk_ids[{i}]", f"must be < {num_chunks} (the primary's chunks), got {c}")
        return TransferJob(next(_job_ids), valid, np.asarray(chunks, dtype=np.int64), promotion, self.req)

    def store(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], timeout: float = 60.0) -> JobResult:
        """Store ``keys`` from primary slots ``chunk_ids``; wait for the result."""
        timeout = timeout_arg("timeout", timeout, allow_none=False)
        job = self._job(keys, chunk_ids, False)
        t0 = _now()
        try:
            self.tier.submit_store(job)
        finally:
            self.cost.ns += _now() - t0
        return self.wait(job.job_id, timeout)

    def load(self, keys: Sequence[OffloadKey], chunk_ids: Sequence[int], timeout: float = 60.0) -> JobResult:
        """Load ``keys`` into primary slots ``chunk_ids``; wait for the result."""
        timeout = timeout_arg("timeout", timeout, allow_none=False)
        job = self._job(keys, chunk_ids, True)
        t0 = _now()
        try:
            self.tier.submit_load(job)
        finally:
            self.cost.ns += _now() - t0
        return self.wait(job.job_id, timeout)

    def lookup(self, keys: Sequence[OffloadKey], timeout: float = 10.0) -> list[LookupResult]:
        """Resolve each key, stepping the tier until no answer is RETRY (as
        one request, which waits out ``timeout`` rather than the namespace's
        ``lookup_retry_budget_ms``)."""
        valid = validate_keys(keys)
        deadline = time.monotonic() + timeout_arg("timeout", timeout, allow_none=False)
        # This call's request: the driver's context (tenant, salt, params), counted afresh.
        req = dataclasses.replace(
            self.req, retries=0, retry_budget_s=float("inf"), retry_since=None, retry_round=-2, cost_reported=False
        )
        try:
            while True:
                t0 = _now()
                try:
                    results = [self.tier.lookup(k, req) for k in valid]
                finally:
                    self.cost.ns += _now() - t0
                if LookupResult.RETRY not in results or time.monotonic() > deadline:
                    return results
                self._step()
                time.sleep(0.0005)
        finally:
            self.req.prefix_resolved = req.prefix_resolved  # the driver's prefix is resolved once, as before
            t0 = _now()
            try:
                self.tier.on_request_finished(req)
            finally:
                self.cost.ns += _now() - t0
            self.cost.request_finished(req)
            self.cost.export()
