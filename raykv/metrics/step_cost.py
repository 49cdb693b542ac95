"""raykv's cost on an engine's scheduler thread, per engine step and per request.

An engine integration (the vLLM tier adapters, ``raykv.integrations.vllm.tiers``;
``TierDriver`` for other engines) owns one ``StepCost`` per engine and:

- adds the nanoseconds each of its calls into a raykv tier took to ``ns``
  (``time.perf_counter_ns`` around the call: lookup, submit_store,
  submit_load, get_finished_jobs, on_new_request, touch, on_request_finished,
  on_schedule_end, has_pending_work, take_events, get_stats);
- calls ``step_end`` once per engine step (vLLM: from the last raykv tier's
  ``on_schedule_end``, which vLLM 0.29-0.33 call on every tier once per
  scheduler step);
- calls ``request_finished`` once per request with the request's context:
  the RETRY answers it got (``ReqContext.retries``, counted by the tiers).

Polls (checks of in-flight actor calls on the engine-side paths: job and
liveness polls, directory answers; reads of ``raykv.core.outcomes.CallOutcome``,
no ``ray.wait``) and lookup waits (``lookup_wait_ms``) are counted
process-wide in ``COUNTS`` by the code that makes them; each step takes the
growth since the step before. A CPU engine's pause in a step that ran nothing
(``raykv.engine.idle_steps``: every request it had waited for another engine's copy)
is counted in ``COUNTS.idle_ns`` and taken out of that step's cost: no request
waited on it. Two engines stepping in one process (tests
only; deployments run one engine per process) would share those counts.

Measuring costs two clock reads and an integer add per call. Nothing is
exported per call or per step: samples wait in bounded lists and go to Ray's
metrics (``raykv_engine_*``, ``raykv_request_retries``) at most once per
``EXPORT_PERIOD_S``, and to vLLM's own metrics when vLLM asks for its stats
(``raykv.integrations.vllm.stats``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from raykv.core.contract import ReqContext
from raykv.core.node import process_node_id
from raykv.metrics.catalog import RETRY_BOUNDARIES, STEP_BOUNDARIES, counter, histogram

__all__ = ["COUNTS", "RETRY_BOUNDARIES", "STEP_BOUNDARIES", "StepCost"]

logger = logging.getLogger(__name__)


class Counts:
    """Process-wide counts of what engine-side code waited on (``COUNTS``)."""

    __slots__ = ("polls", "waits", "wait_ns", "idle_ns")

    def __init__(self) -> None:
        self.polls = 0  # checks of in-flight calls that do not wait
        self.waits = 0  # waits for a call's outcome that may block (a request's first lookup, lookup_wait_ms)
        self.wait_ns = 0  # time spent in those
        #: Pauses of steps that ran nothing (``raykv.engine.idle_steps``): not raykv's step cost.
        self.idle_ns = 0


COUNTS = Counts()


class StepCost:
    """raykv's cost on one engine's scheduler thread (see the module doc)."""

    #: Seconds between exports to Ray's metrics.
    EXPORT_PERIOD_S = 1.0
    #: Step (and request) samples kept per export window; past it, a window's
    #: histogram sees its first ones (counts and sums stay exact). One Ray
    #: ``Histogram.observe`` costs ~3.4 µs here: at most ~0.9 ms once a second.
    MAX_SAMPLES = 256
    #: Recent steps kept for ``snapshot``'s quantiles.
    RECENT = 4096

    def __init__(self, node: str | Callable[[], str] | None = None) -> None:
        #: Nanoseconds in raykv since the last ``step_end`` (callers add to it).
        self.ns = 0
        self._node = node
        self.steps = 0
        self.tier_ns = 0  # in closed steps
        self.polls = 0
        self.waits = 0
        self.wait_ns = 0
        self.requests = 0
        self.retries = 0
        self.idle_ns = 0
        self._seen = (COUNTS.polls, COUNTS.waits, COUNTS.wait_ns, COUNTS.idle_ns)
        self._recent: deque[int] = deque(maxlen=self.RECENT)
        self._ray_steps: list[int] = []
        self._ray_retries: list[int] = []
        self._ray_seen = (0, 0, 0, 0, 0, 0)  # steps, tier_ns, polls, waits, wait_ns, idle_ns
        self._vllm_steps: list[int] = []
        self._vllm_retries: list[int] = []
        self._vllm_seen = (0, 0, 0, 0, 0, 0)
        self._next_export = 0  # monotonic ns
        #: The integration's members (vLLM: the engine's raykv tiers, in the
        #: order vLLM calls them); ``closer`` ends each step.
        self.members: list[object] = []

    # -- the step -----------------------------------------------------------
    @property
    def closer(self) -> object | None:
        """The member whose ``on_schedule_end`` ends each step (the last)."""
        return self.members[-1] if self.members else None

    def step_end(self) -> None:
        """Close one engine step: its raykv time is what ``ns`` gathered since the last."""
        t0 = time.perf_counter_ns()
        polls, waits, wait_ns, idle_ns = COUNTS.polls, COUNTS.waits, COUNTS.wait_ns, COUNTS.idle_ns
        seen = self._seen
        idle = idle_ns - seen[3]  # the step ran nothing and slept: no request waited on raykv's work
        ns, self.ns = max(0, self.ns - idle), 0
        self.steps += 1
        self.tier_ns += ns
        self.polls += polls - seen[0]
        self.waits += waits - seen[1]
        self.wait_ns += wait_ns - seen[2]
        self.idle_ns += idle
        self._seen = (polls, waits, wait_ns, idle_ns)
        self._recent.append(ns)
        if len(self._ray_steps) < self.MAX_SAMPLES:
            self._ray_steps.append(ns)
        if len(self._vllm_steps) < self.MAX_SAMPLES:
            self._vllm_steps.append(ns)
        now = time.monotonic_ns()
        if now >= self._next_export:
            self._next_export = now + int(self.EXPORT_PERIOD_S * 1e9)
            self.export()
        self.ns += time.perf_counter_ns() - t0  # this bookkeeping is raykv's too: next step's

    def request_finished(self, req_context: ReqContext | None) -> None:
        """Count one finished request's RETRY answers (once per request, whichever tier reports)."""
        if req_context is None or getattr(req_context, "cost_reported", True):
            return
        req_context.cost_reported = True
        retries = req_context.retries
        self.requests += 1
        self.retries += retries
        if len(self._ray_retries) < self.MAX_SAMPLES:
            self._ray_retries.append(retries)
        if len(self._vllm_retries) < self.MAX_SAMPLES:
            self._vllm_retries.append(retries)

    # -- readers -------------------------------------------------------------
    def node(self) -> str:
        """The node tag: the one given, else this process's node now (a process
        may outlive one Ray session and join another: tools, tests)."""
        node = self._node
        if callable(node):
            try:
                node = node()
            except Exception as e:  # noqa: BLE001 - a tag, never a failure
                logger.debug("node of the step meter unknown: %r", e)
                node = None
        if not node:
            try:
                node = process_node_id()
            except Exception:  # noqa: BLE001 - not on Ray
                node = "local"
        return str(node)

    def snapshot(self) -> dict[str, float]:
        """Totals so far and quantiles of the last ``RECENT`` steps (tools, tests)."""
        recent = sorted(self._recent)

        def q(p: float) -> float:
            return recent[min(len(recent) - 1, int(p * len(recent)))] / 1e9 if recent else 0.0

        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "tier_seconds": self.tier_ns / 1e9,
            "step_seconds_mean": self.tier_ns / 1e9 / steps,
            "step_seconds_p50": q(0.5),
            "step_seconds_p99": q(0.99),
            "polls": self.polls,
            "polls_per_step": self.polls / steps,
            "lookup_waits": self.waits,
            "lookup_wait_seconds": self.wait_ns / 1e9,
            "idle_pause_seconds": self.idle_ns / 1e9,
            "requests": self.requests,
            "retries": self.retries,
            "retries_per_request": self.retries / max(self.requests, 1),
        }

    def _totals(self) -> tuple[int, int, int, int, int, int]:
        return (self.steps, self.tier_ns, self.polls, self.waits, self.wait_ns, self.idle_ns)

    def take(self) -> tuple[dict[str, float], list[float], list[int]]:
        """For vLLM's stats: growth since the last ``take`` (steps, tier
        seconds, polls, lookup waits, wait seconds), step seconds, and RETRY
        answers of the requests that finished."""
        totals = self._totals()
        seen, self._vllm_seen = self._vllm_seen, totals
        steps, self._vllm_steps = self._vllm_steps, []
        retries, self._vllm_retries = self._vllm_retries, []
        d = [a - b for a, b in zip(totals, seen)]
        deltas = {
            "steps": d[0],
            "tier_seconds": d[1] / 1e9,
            "polls": d[2],
            "lookup_waits": d[3],
            "lookup_wait_seconds": d[4] / 1e9,
        }
        return deltas, [ns / 1e9 for ns in steps], retries

    def export(self) -> None:
        """Hand what was measured since the last export to Ray's metrics (no remote call)."""
        steps, self._ray_steps = self._ray_steps, []
        retries, self._ray_retries = self._ray_retries, []
        totals = self._totals()
        seen, self._ray_seen = self._ray_seen, totals
        d = [a - b for a, b in zip(totals, seen)]
        if not (steps or retries or any(d)):
            return
        tags = {"node": self.node()}
        try:
            hist = histogram("raykv_engine_step_seconds") if steps else None
            if hist is not None:
                for ns in steps:
                    hist.observe(ns / 1e9, tags=tags)
            hist = histogram("raykv_request_retries") if retries else None
            if hist is not None:
                for n in retries:
                    hist.observe(n, tags=tags)
            for name, value in (
                ("raykv_engine_steps", d[0]),
                ("raykv_engine_tier_seconds", d[1] / 1e9),
                ("raykv_engine_polls", d[2]),
                ("raykv_engine_lookup_waits", d[3]),
                ("raykv_engine_lookup_wait_seconds", d[4] / 1e9),
                ("raykv_engine_idle_seconds", d[5] / 1e9),
            ):
                if value:
                    m = counter(name)
                    if m is not None:
                        m.inc(value, tags=tags)
        except Exception as e:  # noqa: BLE001 - metrics are best effort
            logger.debug("engine step metrics not recorded: %r", e)
