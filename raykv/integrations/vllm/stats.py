"""raykv tier counts in vLLM's own metrics (``get_stats`` / ``build_metric_definitions``).

vLLM's tiering manager already counts queries and hits per tier
(``vllm:kv_offload_tiering_chunk_queries`` / ``_chunk_hits``). raykv adds what
only it knows, as ``vllm:raykv_*`` series labelled by tier: blocks moved by its
jobs, lookups answered without an answer yet (RETRY), and failed jobs by
reason, so vLLM's ``/metrics`` tells why a tier missed.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata

#: raykv engine-side total (``TierMetrics.totals``) -> vLLM series, description.
COUNTERS = {
    "raykv_lookup_hits": ("vllm:raykv_lookup_hits", "raykv tier lookups answered HIT"),
    "raykv_lookup_misses": ("vllm:raykv_lookup_misses", "raykv tier lookups answered MISS"),
    "raykv_lookup_retries": ("vllm:raykv_lookup_retries", "raykv tier lookups answered RETRY (directory asked)"),
    "raykv_blocks_loaded": ("vllm:raykv_blocks_loaded", "blocks loaded from the raykv tier"),
    "raykv_blocks_stored": ("vllm:raykv_blocks_stored", "blocks stored into the raykv tier"),
}
FAILURES = "vllm:raykv_job_failures"


class TierStats:
    """Turns a raykv tier's running totals into per-call deltas for vLLM."""

    def __init__(self, tier_type: str) -> None:
        self.labels = (tier_type,)
        self._seen: dict[Any, int] = {}

    @staticmethod
    def definitions() -> dict[str, Any]:
        defs: dict[str, Any] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=("tier",)) for name, doc in COUNTERS.values()
        }
        defs[FAILURES] = OffloadingCounterMetadata(
            documentation="failed raykv store/load jobs by kind and reason", labelnames=("tier", "kind", "reason")
        )
        return defs

    def take(self, metrics: Any) -> OffloadingConnectorStats | None:
        """Deltas since the last call of ``metrics`` (a ``raykv.metrics.recorders.TierMetrics``)."""
        if metrics is None:
            return None
        stats = OffloadingConnectorStats()
        for total_name, (series, _) in COUNTERS.items():
            self._add(stats, series, total_name, metrics.totals.get(total_name, 0), self.labels)
        for (kind, reason), n in list(metrics.failure_totals.items()):
            self._add(stats, FAILURES, (kind, reason), n, (*self.labels, kind, reason))
        return None if stats.is_empty() else stats

    def _add(self, stats: OffloadingConnectorStats, series: str, key: Any, total: int, labels: tuple) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            self._seen[key] = total
            stats.increase_counter(series, delta, labels)
