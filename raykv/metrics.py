"""raykv's Ray metrics: one catalog of every metric, and cheap recorders.

Every metric raykv exports is declared once in ``SPECS`` (name, kind, tags);
``metric(name)`` creates its ``ray.util.metrics`` object lazily, once per
process, and refuses names that are not declared, so the catalog is the
complete list (the Grafana dashboard test checks its queries against it).
Ray exports them on each node's metrics port as ``ray_<name>`` (counters
with ``_total``, histograms as ``_bucket`` / ``_sum`` / ``_count``).

Recording is local and cheap: engine-side counts are plain integers, pushed
to Ray as deltas at most once per scheduler step (``TierMetrics.flush``);
tier actors and directory shards publish after each batched call. No metric
ever costs a remote call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from raykv.contract import JobResult, LookupResult, TransferJob
from raykv.jobs import FailureLog, JobTracker, failure_reason

logger = logging.getLogger(__name__)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

#: Job latency buckets (seconds): sub-millisecond plasma hits to slow shared storage.
LATENCY_BOUNDARIES = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

ENGINE_TAGS = ("tier", "node")
JOB_TAGS = ("tier", "node", "kind")
ACTOR_TAGS = ("tier", "node", "holder")


@dataclass(frozen=True)
class MetricSpec:
    """One raykv metric."""

    name: str
    kind: str
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()

    def exported_names(self) -> list[str]:
        """The series names Prometheus sees on a node's metrics port."""
        base = f"ray_{self.name}"
        if self.kind == COUNTER:
            return [f"{base}_total"]
        if self.kind == HISTOGRAM:
            return [f"{base}_bucket", f"{base}_sum", f"{base}_count"]
        return [base]


_SPECS = (
    # -- engine side: per tier (type) and node, recorded by DirectoryBackedTier
    MetricSpec("raykv_lookups", COUNTER, "lookups answered HIT or MISS", ENGINE_TAGS),
    MetricSpec("raykv_lookup_hits", COUNTER, "lookups answered HIT", ENGINE_TAGS),
    MetricSpec("raykv_lookup_misses", COUNTER, "lookups answered MISS", ENGINE_TAGS),
    MetricSpec("raykv_lookup_retries", COUNTER, "lookups answered RETRY (directory asked)", ENGINE_TAGS),
    MetricSpec("raykv_blocks_stored", COUNTER, "blocks stored into the tier by jobs", ENGINE_TAGS),
    MetricSpec("raykv_blocks_loaded", COUNTER, "blocks loaded from the tier by jobs", ENGINE_TAGS),
    MetricSpec("raykv_bytes_stored", COUNTER, "bytes stored into the tier by jobs", ENGINE_TAGS),
    MetricSpec("raykv_bytes_loaded", COUNTER, "bytes loaded from the tier by jobs", ENGINE_TAGS),
    MetricSpec("raykv_jobs_finished", COUNTER, "store/load jobs finished (success or failure)", JOB_TAGS),
    MetricSpec("raykv_jobs_failed", COUNTER, "store/load jobs that failed (wholly or partly)", JOB_TAGS),
    MetricSpec(
        "raykv_job_failures", COUNTER,
        "failed store/load jobs by reason (timeout, holder_unavailable, full, corrupt, not_held, bad_job, "
        "shut_down, other)", (*JOB_TAGS, "reason"),
    ),
    MetricSpec(
        "raykv_job_latency_seconds", HISTOGRAM, "submit-to-result time of store/load jobs", JOB_TAGS,
        LATENCY_BOUNDARIES,
    ),
    # -- tier actors: per tier, node and holder (one object store actor per node, one fs actor per root)
    MetricSpec("raykv_tier_blocks", GAUGE, "blocks held by the tier actor", ACTOR_TAGS),
    MetricSpec("raykv_tier_bytes", GAUGE, "bytes of blocks held by the tier actor", ACTOR_TAGS),
    MetricSpec("raykv_tier_capacity_bytes", GAUGE, "byte capacity of the tier actor (0: unlimited)", ACTOR_TAGS),
    MetricSpec("raykv_tier_stored_blocks", COUNTER, "blocks the tier actor took in", ACTOR_TAGS),
    MetricSpec("raykv_tier_evicted_blocks", COUNTER, "blocks evicted to stay within capacity", ACTOR_TAGS),
    MetricSpec("raykv_tier_served_blocks", COUNTER, "blocks the tier actor copied to engines", ACTOR_TAGS),
    MetricSpec("raykv_tier_load_misses", COUNTER, "blocks asked of the tier actor but not loaded (not held, or failed)", ACTOR_TAGS),
    MetricSpec("raykv_tier_removed_blocks", COUNTER, "blocks dropped as corrupt or missing", ACTOR_TAGS),
    MetricSpec(
        "raykv_object_store_served_remote_blocks", COUNTER, "blocks handed to another node's actor", ACTOR_TAGS
    ),
    # -- directory shards
    MetricSpec("raykv_directory_keys", GAUGE, "keys known to the directory shard", ("shard",)),
    MetricSpec("raykv_directory_holders", GAUGE, "holders (tier actors) known to the directory shard", ("shard",)),
    MetricSpec("raykv_directory_lookup_keys", COUNTER, "keys looked up at the directory shard", ("shard",)),
    MetricSpec(
        "raykv_directory_invalidations", COUNTER,
        "directory entries dropped (reason: evicted, or why the holder went: removed, restarted, "
        "ActorDiedError, ...)", ("shard", "reason"),
    ),
)

SPECS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}

_lock = threading.Lock()
_created: dict[str, Any] = {}


def exported_names() -> set[str]:
    """Every series name raykv can export (``ray_`` prefixed, as Prometheus sees it)."""
    return {n for spec in SPECS.values() for n in spec.exported_names()}


def metric(name: str) -> Any | None:
    """The process's Ray metric object for ``name`` (None when Ray metrics are unavailable)."""
    spec = SPECS[name]  # KeyError: declare every metric in SPECS
    m = _created.get(name)
    if m is not None:
        return m
    with _lock:
        m = _created.get(name)
        if m is None:
            try:
                import ray
                from ray.util import metrics

                if not ray.is_initialized():
                    return None  # do not cache: Ray may connect later
                if spec.kind == COUNTER:
                    m = metrics.Counter(name, description=spec.description, tag_keys=spec.tag_keys)
                elif spec.kind == GAUGE:
                    m = metrics.Gauge(name, description=spec.description, tag_keys=spec.tag_keys)
                else:
                    m = metrics.Histogram(
                        name, description=spec.description, boundaries=list(spec.boundaries), tag_keys=spec.tag_keys
                    )
            except Exception as e:  # metrics are best effort
                logger.debug("metric %s unavailable: %r", name, e)
                return None
            _created[name] = m
    return m


def _record(name: str, value: float, tags: Mapping[str, str]) -> None:
    m = metric(name)
    if m is None:
        return
    try:
        kind = SPECS[name].kind
        if kind == COUNTER:
            m.inc(value, tags=dict(tags))
        elif kind == GAUGE:
            m.set(value, tags=dict(tags))
        else:
            m.observe(value, tags=dict(tags))
    except Exception as e:
        logger.debug("metric %s not recorded: %r", name, e)


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
        self._counts: dict[str, int] = {}
        self._jobs: dict[str, dict[str, int]] = {}  # kind -> {"finished": n, "failed": n}
        self._latencies: list[tuple[str, float]] = []
        self._failures: dict[tuple[str, str], int] = {}  # (kind, reason) -> n
        self.failure_log = FailureLog(f"raykv {tier} tier on node {node[:12]}:")
        self.totals: dict[str, int] = {}  # everything ever flushed (tools and tests)
        #: every failure ever counted, by (kind, reason) (tools, tests, vLLM stats)
        self.failure_totals: dict[tuple[str, str], int] = {}

    def lookup(self, result: LookupResult) -> None:
        self._lookups[result] = self._lookups.get(result, 0) + 1

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
        with self._lock:
            counts, self._counts = self._counts, {}
            jobs, self._jobs = self._jobs, {}
            latencies, self._latencies = self._latencies, []
            failures, self._failures = self._failures, {}
        for (kind, reason), n in failures.items():
            _record("raykv_job_failures", n, {**self.tags, "kind": kind, "reason": reason})
        counts.update(
            {"raykv_lookups": hits + misses, "raykv_lookup_hits": hits, "raykv_lookup_misses": misses,
             "raykv_lookup_retries": retries}
        )
        for name, value in counts.items():
            if value:
                self.totals[name] = self.totals.get(name, 0) + value
                _record(name, value, self.tags)
        for kind, per in jobs.items():
            tags = {**self.tags, "kind": kind}
            for what in ("finished", "failed"):
                if per[what]:
                    name = f"raykv_jobs_{what}"
                    self.totals[name] = self.totals.get(name, 0) + per[what]
                    _record(name, per[what], tags)
        for kind, seconds in latencies:
            _record("raykv_job_latency_seconds", seconds, {**self.tags, "kind": kind})


class MeteredJobTracker(JobTracker):
    """A ``JobTracker`` that accounts every finished job in a ``TierMetrics``."""

    def __init__(self, metrics: TierMetrics, block_bytes: int) -> None:
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


class ActorMetrics:
    """A tier actor's occupancy (gauges) and traffic (counters, sent as deltas).

    ``counter_names`` maps the actor's own counter keys to catalog names.
    Ray drops a gauge series from the metrics port when it is not set for a
    while (~20 s in Ray 2.60), so on an event loop the last occupancy is set
    again every ``GAUGE_REFRESH_S`` while the actor lives.
    """

    GAUGE_REFRESH_S = 5.0

    def __init__(self, tier: str, node: str | None, holder: str, counter_names: Mapping[str, str]) -> None:
        self.tags = {"tier": tier, "node": node or "shared", "holder": holder}
        self.counter_names = dict(counter_names)
        self._last: dict[str, int] = {}
        self._occupancy: tuple[int, int, int] | None = None
        self._refresher: Any = None

    def record(self, blocks: int, nbytes: int, capacity: int, counters: Mapping[str, int]) -> None:
        """Set the occupancy gauges and add the counters' growth since the last call."""
        self._occupancy = (int(blocks), int(nbytes), int(capacity))
        self._set_gauges()
        for key, name in self.counter_names.items():
            delta = counters.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                _record(name, delta, self.tags)
                self._last[key] = counters.get(key, 0)
        if self._refresher is None:
            self._start_refresher()

    def _set_gauges(self) -> None:
        if self._occupancy is not None:
            blocks, nbytes, capacity = self._occupancy
            _record("raykv_tier_blocks", blocks, self.tags)
            _record("raykv_tier_bytes", nbytes, self.tags)
            _record("raykv_tier_capacity_bytes", capacity, self.tags)

    def _start_refresher(self) -> None:
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on an event loop: gauges are set at each record only

        async def refresh() -> None:
            while True:
                await asyncio.sleep(self.GAUGE_REFRESH_S)
                self._set_gauges()

        self._refresher = loop.create_task(refresh())


async def publish_shard_metrics(shard: Any, period_s: float = 1.0) -> None:
    """Forever: a directory shard's keys, holders, lookups and invalidations.

    ``shard`` is a ``DirectoryShardImpl`` (its ``index``, ``num_keys``,
    ``_holders``, ``looked_up`` and ``invalidated`` counters). Runs as a task
    on the shard actor's event loop; each round only records locally.
    """
    import asyncio

    tags = {"shard": str(shard.index)}
    seen_lookups = 0
    seen: dict[str, int] = {}
    while True:
        try:
            _record("raykv_directory_keys", shard.num_keys, tags)
            _record("raykv_directory_holders", len(shard._holders), tags)
            if shard.looked_up > seen_lookups:
                _record("raykv_directory_lookup_keys", shard.looked_up - seen_lookups, tags)
                seen_lookups = shard.looked_up
            for reason, n in list(shard.invalidated.items()):
                if n > seen.get(reason, 0):
                    _record("raykv_directory_invalidations", n - seen.get(reason, 0), {**tags, "reason": reason})
                    seen[reason] = n
        except Exception as e:  # never let metrics take the shard down
            logger.debug("directory shard metrics not published: %r", e)
        await asyncio.sleep(period_s)


def parse_prometheus(text: str, prefix: str = "ray_raykv_") -> list[tuple[str, dict[str, str], float]]:
    """(series name, labels, value) of the raykv series in a metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out.append((sample.name, dict(sample.labels), float(sample.value)))
    return out


def scrape_node(host: str, port: int, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """The raykv series on one node's metrics export port."""
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode())


def scrape_cluster(timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """The raykv series of every alive node of the connected cluster (unreachable nodes skipped)."""
    import ray

    out: list[tuple[str, dict[str, str], float]] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            out += scrape_node(node["NodeManagerAddress"], int(port), timeout)
        except Exception as e:
            logger.debug("metrics of node %s unreadable: %r", node.get("NodeID"), e)
    return out


def sum_series(series: Iterable[tuple[str, dict[str, str], float]], name: str, by: str) -> dict[str, float]:
    """Sum of series ``name`` grouped by label ``by``."""
    out: dict[str, float] = {}
    for n, labels, value in series:
        if n == name:
            key = labels.get(by, "")
            out[key] = out.get(key, 0.0) + value
    return out
