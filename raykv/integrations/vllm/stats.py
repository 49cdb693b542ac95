"""raykv tier counts in vLLM's own metrics (``get_stats`` / ``build_metric_definitions``).

vLLM's tiering manager already counts queries and hits per tier
(``vllm:kv_offload_tiering_chunk_queries`` / ``_chunk_hits``). raykv adds what
only it knows, as ``vllm:raykv_*`` series labelled by tier: blocks moved by its
jobs, lookups answered without an answer yet (RETRY), and failed jobs by
reason, so vLLM's ``/metrics`` tells why a tier missed. Per engine (no tier
label; ``raykv.metrics.step_cost``): raykv's time on the scheduler thread per step,
its polls and lookup waits, and the RETRY answers of each finished request.
``read_step_cost`` reads those back from ``LLM.get_metrics()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Metric

from raykv.metrics.recorders import TierMetrics
from raykv.metrics.step_cost import RETRY_BOUNDARIES, STEP_BOUNDARIES, StepCost

#: raykv engine-side total (``TierMetrics.totals``) -> vLLM series, description.
COUNTERS = {
    "raykv_lookup_hits": ("vllm:raykv_lookup_hits", "raykv tier lookups answered HIT"),
    "raykv_lookup_misses": ("vllm:raykv_lookup_misses", "raykv tier lookups answered MISS"),
    "raykv_lookup_retries": ("vllm:raykv_lookup_retries", "raykv tier lookups answered RETRY (directory asked)"),
    "raykv_lookup_retry_budget_misses": (
        "vllm:raykv_lookup_retry_budget_misses",
        "raykv tier lookups answered MISS because the request had waited out lookup_retry_budget_ms",
    ),
    "raykv_blocks_loaded": ("vllm:raykv_blocks_loaded", "blocks loaded from the raykv tier"),
    "raykv_blocks_stored": ("vllm:raykv_blocks_stored", "blocks stored into the raykv tier"),
}
FAILURES = "vllm:raykv_job_failures"
VIEW_UNANSWERED = "vllm:raykv_lookup_view_unanswered"
#: Per engine: ``StepCost.take`` delta -> vLLM series, description.
ENGINE_COUNTERS = {
    "steps": ("vllm:raykv_engine_steps", "engine steps measured by raykv"),
    "tier_seconds": (
        "vllm:raykv_engine_tier_seconds",
        "time the scheduler thread spent inside raykv's tier methods, all steps",
    ),
    "polls": ("vllm:raykv_engine_polls", "non-blocking ray.wait polls made by raykv's tiers"),
    "lookup_waits": ("vllm:raykv_engine_lookup_waits", "requests' first lookups that waited for the directory"),
    "lookup_wait_seconds": ("vllm:raykv_engine_lookup_wait_seconds", "time those lookups waited"),
}
STEP_SECONDS = "vllm:raykv_engine_step_seconds"
REQUEST_RETRIES = "vllm:raykv_request_retries"


class TierStats:
    """Turns a raykv tier's running totals into per-call deltas for vLLM."""

    def __init__(self, tier_type: str) -> None:
        self.labels = (tier_type,)
        self._seen: dict[str | tuple[str, str], int] = {}

    @staticmethod
    def definitions() -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=("tier",)) for name, doc in COUNTERS.values()
        }
        defs[FAILURES] = OffloadingCounterMetadata(
            documentation="failed raykv store/load jobs by kind and reason", labelnames=("tier", "kind", "reason")
        )
        defs[VIEW_UNANSWERED] = OffloadingCounterMetadata(
            documentation="requests' first lookups the node's directory view left keys of to ask the agent for, "
            "by why (raykv.directory.view_overlay.UNANSWERED)",
            labelnames=("tier", "why"),
        )
        for name, doc in ENGINE_COUNTERS.values():
            defs[name] = OffloadingCounterMetadata(documentation=doc)
        defs[STEP_SECONDS] = OffloadingHistogramMetadata(
            documentation="time the scheduler thread spent inside raykv's tier methods, per engine step",
            buckets=STEP_BOUNDARIES,
        )
        defs[REQUEST_RETRIES] = OffloadingHistogramMetadata(
            documentation="RETRY answers raykv's tiers gave one request (when it finished)", buckets=RETRY_BOUNDARIES
        )
        return defs

    def take(self, metrics: TierMetrics | None, step_cost: StepCost | None = None) -> OffloadingConnectorStats | None:
        """Deltas since the last call of ``metrics`` (a ``raykv.metrics.recorders.TierMetrics``)
        and, from the engine's one reporting tier, of ``step_cost`` (a ``raykv.metrics.step_cost.StepCost``)."""
        stats = OffloadingConnectorStats()
        if metrics is not None:
            for total_name, (series, _) in COUNTERS.items():
                self._add(stats, series, total_name, metrics.totals.get(total_name, 0), self.labels)
            for (kind, reason), n in list(metrics.failure_totals.items()):
                self._add(stats, FAILURES, (kind, reason), n, (*self.labels, kind, reason))
            for why, n in list(metrics.unanswered_totals.items()):
                self._add(stats, VIEW_UNANSWERED, ("view", why), n, (*self.labels, why))
        if step_cost is not None and step_cost.steps + step_cost.requests:
            deltas, steps, retries = step_cost.take()
            for key, (series, _) in ENGINE_COUNTERS.items():
                if deltas[key] > 0:
                    stats.increase_counter(series, deltas[key])
            for seconds in steps:
                stats.observe_histogram(STEP_SECONDS, seconds)
            for n in retries:
                stats.observe_histogram(REQUEST_RETRIES, n)
        return None if stats.is_empty() else stats

    def _add(
        self,
        stats: OffloadingConnectorStats,
        series: str,
        key: str | tuple[str, str],
        total: int,
        labels: tuple[str, ...],
    ) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            self._seen[key] = total
            stats.increase_counter(series, delta, labels)


def _quantile(buckets: Mapping[str, float], count: float, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (vLLM's cumulative buckets)."""
    if count <= 0:
        return None
    bounds = sorted((float(le), float(n)) for le, n in buckets.items())
    for le, n in bounds:
        if n >= q * count:
            return le
    return float("inf")


def read_step_cost(metrics: Iterable[Metric]) -> dict[str, float | None]:
    """raykv's cost in an engine, from ``LLM.get_metrics()`` (the ``vllm:raykv_engine_*``
    and ``vllm:raykv_request_retries`` series, summed over engines): steps, seconds
    in raykv (total, mean per step, p50 / p99 per step as bucket upper bounds),
    polls and lookup waits (a count) per step, finished requests and RETRYs per request."""
    out: dict[str, float | None] = {key: 0.0 for key in ENGINE_COUNTERS}
    steps_hist: dict[str, float] = {}
    step_count = step_sum = req_count = req_sum = 0.0
    series = {name: key for key, (name, _) in ENGINE_COUNTERS.items()}
    for m in metrics:
        if m.name in series and isinstance(m, (Counter, Gauge)):
            out[series[m.name]] = (out[series[m.name]] or 0.0) + float(m.value)
        elif m.name == STEP_SECONDS and isinstance(m, Histogram):
            step_count += float(m.count)
            step_sum += float(m.sum)
            for le, n in m.buckets.items():
                steps_hist[le] = steps_hist.get(le, 0.0) + float(n)
        elif m.name == REQUEST_RETRIES and isinstance(m, Histogram):
            req_count += float(m.count)
            req_sum += float(m.sum)
    # LLM.get_metrics() reads counters as ints: raykv's seconds come from the
    # step histogram's sum (every step is one sample), the waits' time not at all.
    out.pop("lookup_wait_seconds")
    out["tier_seconds"] = step_sum
    steps = out["steps"] or 0.0
    out["step_seconds_mean"] = step_sum / step_count if step_count else None
    out["step_seconds_p50"] = _quantile(steps_hist, step_count, 0.5)
    out["step_seconds_p99"] = _quantile(steps_hist, step_count, 0.99)
    out["polls_per_step"] = (out["polls"] or 0.0) / steps if steps else None
    out["lookup_waits_per_step"] = (out["lookup_waits"] or 0.0) / steps if steps else None
    out["requests"] = req_count
    out["retries"] = req_sum
    out["retries_per_request"] = req_sum / req_count if req_count else None
    return out
