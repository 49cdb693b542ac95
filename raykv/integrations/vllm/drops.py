"""Blocks that vLLM's cascade never offered to raykv: the CPU primary was full.

How blocks get lost between the engine and raykv's tiers (read in vLLM 0.32's
``v1/kv_offload/tiering/manager.py``, ``cpu/manager.py`` and the offloading
connector's ``scheduler.py``; 0.33 reads the same):

- The cascade itself never drops a block that reached the primary:
  ``TieringOffloadingManager.complete_store`` makes the chunks readable and, in
  the same call, pins them (``create_store_job`` -> ``prepare_read``) and hands
  them to every secondary tier, so they cannot be evicted before the tiers
  copied them. (A tier's back-pressure detector can skip a tier; raykv's
  tiers run without one unless ``backpressure`` is configured.)
- Blocks are dropped *before* the primary: ``prepare_store`` returns None when
  the primary cannot free enough chunks (every chunk is pinned by a cascade or
  a promotion in flight, or is still being written, or the step offered more
  chunks than the primary has). The connector then skips those blocks, retries
  them next step while the request runs, and forgets them once the request has
  finished: they reach no secondary tier.

vLLM counts the refusals (``vllm:kv_offload_allocation_failure``: one per
refused ``prepare_store`` call, retries included, not blocks), and the
secondary-tier contract has no hook that sees them (a tier only sees what was
cascaded). raykv owns the offloading spec (``RaykvOffloadingSpec``), so it
wraps the manager the spec builds and counts, per request, the keys whose
store was refused and that were neither stored later nor found in the primary
when the request finished: ``raykv_cascade_dropped_blocks`` (Ray metric, by
node and raykv namespace) and ``vllm:raykv_cascade_dropped_blocks`` (vLLM's
metrics, ``LLM.get_metrics()``). A block that two requests computed at once and
both failed to store counts twice: both computations are lost to raykv.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING

from raykv.metrics.catalog import record

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import (
        OffloadingManager,
        OffloadingMetricMetadata,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
    )

logger = logging.getLogger(__name__)

#: vLLM series (``LLM.get_metrics()``, the engine's ``/metrics``).
SERIES = "vllm:raykv_cascade_dropped_blocks"
DOCUMENTATION = (
    "KV blocks the engine computed that never reached the CPU primary (it was full), "
    "so vLLM's cascade could not offer them to any secondary tier"
)
#: raykv's Ray metric (``raykv.metrics.catalog``).
METRIC = "raykv_cascade_dropped_blocks"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The vLLM metric definition of ``SERIES`` (for the spec's ``build_metric_definitions``)."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata

    return {SERIES: OffloadingCounterMetadata(documentation=DOCUMENTATION, labelnames=())}


class CascadeDropCounter:
    """vLLM's offloading manager, forwarded as is, with refused stores counted.

    Every attribute not defined here is the wrapped manager's, so the
    connector sees vLLM's manager (no method is re-implemented). Only
    ``prepare_store`` (refusals, and keys accepted later), ``on_request_finished``
    (what was never stored becomes a drop), ``reset_cache`` and ``get_stats``
    (the count in vLLM's metrics) are watched.
    """

    def __init__(self, manager: OffloadingManager) -> None:
        self._manager = manager
        self._refused: dict[str, set[OffloadKey]] = {}
        self._lock = threading.Lock()
        self.dropped_blocks = 0  # ever (tools, tests)
        self._reported = 0  # already handed to vLLM's stats
        self._tags: dict[str, str] | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self._manager, name)

    # -- watched calls -------------------------------------------------------
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        out = self._manager.prepare_store(keys, req_context)
        req_id = _req_id(req_context)
        if req_id is None:
            return out
        with self._lock:
            if out is None:
                missing = [k for k in keys if not self._in_primary(k, req_context)]
                if missing:
                    self._refused.setdefault(req_id, set()).update(missing)
            elif req_id in self._refused:
                # stored now, or already in the primary: no longer at risk
                self._refused[req_id].difference_update(keys)
        return out

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._manager.on_request_finished(req_context)
        req_id = _req_id(req_context)
        if req_id is None:
            return
        with self._lock:
            refused = self._refused.pop(req_id, None)
            # The connector calls this once every store of the request was
            # offered; a key another request stored meanwhile is not lost.
            dropped = sum(1 for k in refused or () if not self._in_primary(k, req_context))
            self.dropped_blocks += dropped
        if dropped:
            record(METRIC, dropped, self._metric_tags())

    def reset_cache(self) -> None:
        with self._lock:
            self._refused.clear()
        self._manager.reset_cache()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self._manager.get_stats()
        with self._lock:
            delta, self._reported = self.dropped_blocks - self._reported, self.dropped_blocks
        if delta <= 0:
            return stats
        try:
            if stats is None:
                from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

                stats = OffloadingConnectorStats()
            stats.increase_counter(SERIES, delta, ())
        except Exception as e:  # a release without these stats: the Ray metric still counts
            logger.debug("raykv cascade drops not added to vLLM's stats: %r", e)
        return stats

    # -- helpers -------------------------------------------------------------
    def _in_primary(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Whether vLLM's CPU primary holds ``key`` (written or being written).
        ``lookup`` of vLLM's CPU manager only reads its table."""
        primary = getattr(self._manager, "primary_tier", None)
        if primary is None:
            return False
        try:
            return bool(primary.lookup(key, req_context).name != "MISS")
        except Exception:
            return False

    def _metric_tags(self) -> dict[str, str]:
        if self._tags is None:
            node, namespace = "", ""
            for tier in getattr(self._manager, "secondary_tiers", ()):
                services = getattr(getattr(tier, "raykv_tier", None), "services", None)
                if services is not None:
                    node, namespace = services.node_id(), services.config.namespace
                    break
            self._tags = {"node": node, "namespace": namespace}
        return self._tags


def _req_id(req_context: ReqContext | None) -> str | None:
    """The request id of a manager call's ``req_context``."""
    return getattr(req_context, "req_id", None)
