"""Cheap recorders of raykv's metrics (``raykv.metrics.catalog``).

Recording is local and cheap: engine-side counts are plain integers, pushed
to Ray as deltas at most once per scheduler step (``TierMetrics.flush``);
tier actors and directory shards publish after each batched call or on a
timer. No metric ever costs a remote call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypedDict

from raykv.core.contract import JobResult, LookupResult, TransferJob
from raykv.core.jobs import FailureLog, failure_reason
from raykv.core.pins import REFUSED_COUNTERS, PinTable
from raykv.core.tenants import TenantLRU
from raykv.metrics.catalog import record

logger = logging.getLogger(__name__)


class TierMetrics:
    """Engine-side counts of one tier in one process, flushed to Ray as deltas.

    ``lookup`` runs on the scheduler thread; ``job_finished`` on whatever
    thread completes a job. Both only bump local numbers; ``flush`` (once per
    scheduler step) hands the non-zero deltas to Ray.
    """

    def __init__(self, tier: str, node: str) -> None:
        self.tags = {"tier": tier, "node": node}
        self._lock = threading.Lock()
        self._lookups = {LookupResult.HIT: 0, LookupResult.MISS: 0, LookupResult.RETRY: 0}
        self._budget_misses = 0  # MISS answers given because a request's RETRY budget was spent
        self._unanswered: dict[str, int] = {}  # first lookups the node's view left to ask for, by why
        self._counts: dict[str, int] = {}
        self._jobs: dict[str, dict[str, int]] = {}  # kind -> {"finished": n, "failed": n}
        self._latencies: list[tuple[str, float]] = []
        self._failures: dict[tuple[str, str], int] = {}  # (kind, reason) -> n
        self.failure_log = FailureLog(f"raykv {tier} tier on node {node[:12]}:")
        self.totals: dict[str, int] = {}  # everything ever flushed (tools and tests)
        #: every failure ever counted, by (kind, reason) (tools, tests, vLLM stats)
        self.failure_totals: dict[tuple[str, str], int] = {}
        #: every first lookup the node's view left to ask for, by why (tools, tests, vLLM stats)
        self.unanswered_totals: dict[str, int] = {}

    def lookup(self, result: LookupResult) -> None:
        self._lookups[result] = self._lookups.get(result, 0) + 1

    def retry_budget_miss(self) -> None:
        """One lookup answered MISS (also counted by ``lookup``) past its request's RETRY budget."""
        self._budget_misses += 1

    def view_unanswered(self, why: str) -> None:
        """One request's first lookup found keys the node's view could not answer, for ``why``
        (``raykv.directory.view_overlay.UNANSWERED``): it asked the agent."""
        self._unanswered[why] = self._unanswered.get(why, 0) + 1
        self.unanswered_totals[why] = self.unanswered_totals.get(why, 0) + 1

    def job_finished(self, job: TransferJob, result: JobResult, block_bytes: int) -> None:
        """Account one job's result (its kind comes from ``is_promotion``: loads promote)."""
        kind = "load" if job.is_promotion else "store"
        if result.success:
            blocks = len(job.keys)
        else:
            blocks = len(result.successful_keys or ())
        nbytes = result.transfer_bytes if result.success and result.transfer_bytes else blocks * block_bytes
        with self._lock:
            per = self._jobs.setdefault(kind, {"finished": 0, "failed": 0})
            per["finished"] += 1
            per["failed"] += 0 if result.success else 1
            done = "loaded" if job.is_promotion else "stored"
            for name, n in ((f"raykv_blocks_{done}", blocks), (f"raykv_bytes_{done}", nbytes)):
                self._counts[name] = self._counts.get(name, 0) + n
            if result.transfer_time is not None:
                self._latencies.append((kind, result.transfer_time))
            if not result.success:
                reason = failure_reason(result.error)
                self._failures[(kind, reason)] = self._failures.get((kind, reason), 0) + 1
                self.failure_totals[(kind, reason)] = self.failure_totals.get((kind, reason), 0) + 1
        if not result.success:
            self.failure_log.note(kind, reason, result.error)

    def flush(self) -> None:
        """Hand what was counted since the last flush to Ray (no remote call)."""
        hits = self._lookups[LookupResult.HIT]
        misses = self._lookups[LookupResult.MISS]
        retries = self._lookups[LookupResult.RETRY]
        self._lookups[LookupResult.HIT] -= hits
        self._lookups[LookupResult.MISS] -= misses
        self._lookups[LookupResult.RETRY] -= retries
        budget_misses = self._budget_misses
        self._budget_misses -= budget_misses
        if self._unanswered:
            unanswered, self._unanswered = self._unanswered, {}
            for why, n in unanswered.items():
                record("raykv_lookup_view_unanswered", n, {**self.tags, "why": why})
        with self._lock:
            counts, self._counts = self._counts, {}
            jobs, self._jobs = self._jobs, {}
            latencies, self._latencies = self._latencies, []
            failures, self._failures = self._failures, {}
        for (kind, reason), n in failures.items():
            record("raykv_job_failures", n, {**self.tags, "kind": kind, "reason": reason})
        counts.update(
            {
                "raykv_lookups": hits + misses,
                "raykv_lookup_hits": hits,
                "raykv_lookup_misses": misses,
                "raykv_lookup_retries": retries,
                "raykv_lookup_retry_budget_misses": budget_misses,
            }
        )
        for name, value in counts.items():
            if value:
                self.totals[name] = self.totals.get(name, 0) + value
                record(name, value, self.tags)
        for kind, per in jobs.items():
            tags = {**self.tags, "kind": kind}
            for what in ("finished", "failed"):
                if per[what]:
                    name = f"raykv_jobs_{what}"
                    self.totals[name] = self.totals.get(name, 0) + per[what]
                    record(name, per[what], tags)
        for kind, seconds in latencies:
            record("raykv_job_latency_seconds", seconds, {**self.tags, "kind": kind})


#: A tier actor's counter key -> the catalog metric it feeds, with extra tags when it needs them.
CounterName = str | tuple[str, Mapping[str, str]]

#: Pins refused by reason (``raykv.core.pins.REFUSED_COUNTERS``), for every tier actor that keeps pins.
PIN_REFUSAL_COUNTERS: dict[str, CounterName] = {
    counter: ("raykv_tier_pins_refused", {"reason": reason}) for reason, counter in REFUSED_COUNTERS.items()
}


class ActorMetrics:
    """A tier actor's occupancy and pins (gauges) and traffic (counters, sent as deltas).

    ``counter_names`` maps the actor's own counter keys to catalog names.
    Ray drops a gauge series from the metrics port when it is not set for a
    while (~20 s in Ray 2.60), so on an event loop the last occupancy is set
    again every ``GAUGE_REFRESH_S`` while the actor lives. ``pins`` gives the
    actor's tenants and pins (None: it keeps no pins); their gauges walk every
    pin, so they are set at most once per ``PIN_GAUGES_S``, after unpinning
    what expired.
    """

    GAUGE_REFRESH_S = 5.0
    PIN_GAUGES_S = 1.0

    def __init__(
        self,
        tier: str,
        node: str | None,
        holder: str,
        counter_names: Mapping[str, CounterName],
        pins: Callable[[], TenantLRU | None] | None = None,
    ) -> None:
        self.tags = {"tier": tier, "node": node or "shared", "holder": holder}
        self.counter_names = {
            key: (name, self.tags) if isinstance(name, str) else (name[0], {**self.tags, **name[1]})
            for key, name in counter_names.items()
        }
        self._last: dict[str, int] = {}
        self._occupancy: tuple[int, int, int] | None = None
        self._counters: Mapping[str, int] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._pins = pins
        self._pins_set_at = -math.inf
        self._pin_tenants: set[str] = set()  # tenants with pin gauges set: zeroed once their pins go

    def record(self, blocks: int, nbytes: int, capacity: int, counters: Mapping[str, int]) -> None:
        """Set the occupancy gauges and add the counters' growth since the last call.
        ``counters`` is kept: the refresher also sends growth that came after
        (pins are counted once a store's blocks are in, after its last record)."""
        self._occupancy = (int(blocks), int(nbytes), int(capacity))
        self._counters = counters
        self._set_gauges()
        self._add_counters()
        if self._refresher is None:
            self._start_refresher()

    def _add_counters(self) -> None:
        counters = self._counters
        for key, (name, tags) in self.counter_names.items():
            delta = counters.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                record(name, delta, tags)
                self._last[key] = counters.get(key, 0)

    def _set_gauges(self) -> None:
        if self._occupancy is not None:
            blocks, nbytes, capacity = self._occupancy
            record("raykv_tier_blocks", blocks, self.tags)
            record("raykv_tier_bytes", nbytes, self.tags)
            record("raykv_tier_capacity_bytes", capacity, self.tags)
        now = time.monotonic()
        if self._pins is not None and now - self._pins_set_at >= self.PIN_GAUGES_S:
            self._pins_set_at = now
            tenants = self._pins()
            if tenants is not None:
                tenants.expire()
                self._set_pin_gauges(tenants.pins)

    def _set_pin_gauges(self, table: PinTable) -> None:
        record("raykv_tier_pinned_blocks", len(table), self.tags)
        by_tenant = table.bytes_by_tenant()
        expiries = table.next_expiry_by_tenant()
        for tenant in self._pin_tenants - by_tenant.keys():
            record("raykv_tier_pinned_bytes", 0, {**self.tags, "tenant": tenant_metric_label(tenant)})
        for tenant, nbytes in by_tenant.items():
            tags = {**self.tags, "tenant": tenant_metric_label(tenant)}
            record("raykv_tier_pinned_bytes", nbytes, tags)
            if tenant in expiries:
                record("raykv_tier_pin_next_expiry_seconds", expiries[tenant], tags)
        self._pin_tenants = set(by_tenant)

    def _start_refresher(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on an event loop: gauges are set at each record only

        async def refresh() -> None:
            while True:
                await asyncio.sleep(self.GAUGE_REFRESH_S)
                self._set_gauges()
                self._add_counters()

        self._refresher = loop.create_task(refresh())


def tenant_metric_label(tenant: str) -> str:
    """A tenant as a metric label: ``(none)`` for requests that name none (as ``raykv status`` shows it)."""
    return tenant or "(none)"


class ShardFigures(TypedDict):
    """What a directory shard's metrics publish (``publish_shard_metrics``)."""

    num_keys: int
    num_holders: int
    #: Keys looked up, ever.
    looked_up: int
    #: Entries dropped, ever, by reason.
    invalidated: dict[str, int]


async def publish_shard_metrics(shard: int, figures: Callable[[], ShardFigures], period_s: float = 1.0) -> None:
    """Forever: directory shard ``shard``'s keys, holders, lookups and invalidations
    (``figures()``). Runs as a task on the shard actor's event loop; each round
    only records locally.
    """
    tags = {"shard": str(shard)}
    seen_lookups = 0
    seen: dict[str, int] = {}
    while True:
        try:
            f = figures()
            record("raykv_directory_keys", f["num_keys"], tags)
            record("raykv_directory_holders", f["num_holders"], tags)
            if f["looked_up"] > seen_lookups:
                record("raykv_directory_lookup_keys", f["looked_up"] - seen_lookups, tags)
                seen_lookups = f["looked_up"]
            for reason, n in f["invalidated"].items():
                if n > seen.get(reason, 0):
                    record("raykv_directory_invalidations", n - seen.get(reason, 0), {**tags, "reason": reason})
                    seen[reason] = n
        except Exception as e:  # never let metrics take the shard down
            logger.debug("directory shard metrics not published: %r", e)
        await asyncio.sleep(period_s)


class AgentFigures(TypedDict):
    """What a node's directory agent publishes (``publish_agent_metrics``)."""

    view_keys: int
    local_keys: int
    #: Engine lookup calls taken, ever.
    engine_calls: int
    #: Calls to the shards, ever, by method.
    shard_calls: dict[str, int]
    resets: int
    #: Replica lags (seconds) observed since the last round.
    lags: list[float]


async def publish_agent_metrics(node_id: str, figures: Callable[[], AgentFigures], period_s: float = 1.0) -> None:
    """Forever: node ``node_id``'s directory agent's view size, lag and calls
    (``figures()``), recorded locally once per ``period_s`` on the agent's event loop."""
    tags = {"node": node_id}
    seen: dict[str, int] = {}

    def grown(key: str, now: int) -> int:
        delta = now - seen.get(key, 0)
        seen[key] = now
        return delta

    while True:
        try:
            f = figures()
            record("raykv_agent_view_keys", f["view_keys"], tags)
            record("raykv_agent_local_keys", f["local_keys"], tags)
            for lag in f["lags"]:
                record("raykv_agent_lag_seconds", lag, tags)
            if (n := grown("engine_calls", f["engine_calls"])) > 0:
                record("raykv_agent_engine_calls", n, tags)
            record("raykv_agent_view_resets", f["resets"], tags)
            for method, total in f["shard_calls"].items():
                if (n := grown(f"shard:{method}", total)) > 0:
                    record("raykv_agent_shard_calls", n, {**tags, "method": method})
        except Exception as e:  # never let metrics take the agent down
            logger.debug("directory agent metrics not published: %r", e)
        await asyncio.sleep(period_s)
