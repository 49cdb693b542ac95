"""raykv's Ray metrics catalog: every metric, declared once.

Every metric raykv exports is declared once in ``SPECS`` (name, kind, tags);
``metric(name)`` creates its ``ray.util.metrics`` object lazily, once per
process, and refuses names that are not declared, so the catalog is the
complete list (the Grafana dashboard test checks its queries against it).
Ray exports them on each node's metrics port as ``ray_<name>`` (counters
with ``_total``, histograms as ``_bucket`` / ``_sum`` / ``_count``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray.util.metrics import Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

#: Job latency buckets (seconds): sub-millisecond plasma hits to slow shared storage.
LATENCY_BOUNDARIES = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: raykv's time per engine step (``raykv.metrics.step_cost``): 10 µs to 1 s, the
#: issue-21 targets (0.5 ms p50, 2 ms p99) on bucket edges.
STEP_BOUNDARIES = (
    1e-05,
    2.5e-05,
    5e-05,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
#: RETRY answers per request (integers: 0, 1, 2, 3-4, 5-8, ...; Ray wants positive bounds).
RETRY_BOUNDARIES = (0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5)

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
        "raykv_job_failures",
        COUNTER,
        "failed store/load jobs by reason (timeout, holder_unavailable, full, corrupt, not_held, bad_job, "
        "shut_down, other)",
        (*JOB_TAGS, "reason"),
    ),
    MetricSpec(
        "raykv_job_latency_seconds",
        HISTOGRAM,
        "submit-to-result time of store/load jobs",
        JOB_TAGS,
        LATENCY_BOUNDARIES,
    ),
    MetricSpec(
        "raykv_lookup_view_unanswered",
        COUNTER,
        "requests' first lookups the node's directory view left keys of to ask the agent for, by why "
        "(busy: its writer mid-change; stale, no view, remap, decode; not known: a view of asked keys "
        "or one still filling; no holder set; distrusted: after a failed load)",
        (*ENGINE_TAGS, "why"),
    ),
    MetricSpec(
        "raykv_lookup_retry_budget_misses",
        COUNTER,
        "lookups answered MISS instead of RETRY: the request had waited out lookup_retry_budget_ms",
        ENGINE_TAGS,
    ),
    MetricSpec(
        "raykv_pending_decisions",
        COUNTER,
        "requests that met blocks another engine is computing, by what they did (wait: held back "
        "until they register; compute: computed them anyway; loaded: waited and got them; gave_up: the "
        "wait ended without them) and requests that announced blocks they compute (announce; claim: "
        "and held back to see whether another engine announced them first; yield: it had; short: too "
        "few blocks to list, computed as without pending entries; dropped: it ended before storing "
        "blocks it listed, a client that hung up, or their store failed, and their entries ended then)",
        ("node", "decision"),
    ),
    # -- engine side: raykv's cost on the engine's scheduler thread (raykv.metrics.step_cost), per node
    MetricSpec(
        "raykv_engine_step_seconds",
        HISTOGRAM,
        "time the engine's scheduler thread spent inside raykv's tier methods, per engine step",
        ("node",),
        STEP_BOUNDARIES,
    ),
    MetricSpec("raykv_engine_steps", COUNTER, "engine steps measured (raykv_engine_step_seconds)", ("node",)),
    MetricSpec(
        "raykv_engine_tier_seconds",
        COUNTER,
        "time the engine's scheduler thread spent inside raykv's tier methods, all steps",
        ("node",),
    ),
    MetricSpec(
        "raykv_engine_polls",
        COUNTER,
        "non-blocking checks of in-flight actor calls by raykv's tiers in the engine process "
        "(jobs, liveness, directory answers)",
        ("node",),
    ),
    MetricSpec(
        "raykv_engine_lookup_waits",
        COUNTER,
        "times a request's first lookup waited for the directory (lookup_wait_ms)",
        ("node",),
    ),
    MetricSpec(
        "raykv_engine_lookup_wait_seconds",
        COUNTER,
        "time spent waiting for the directory at requests' first lookups (lookup_wait_ms)",
        ("node",),
    ),
    MetricSpec(
        "raykv_engine_idle_seconds",
        COUNTER,
        "time a CPU engine's scheduler paused in steps that ran nothing, every request it had waiting "
        "for another engine's copy or its claim's answer (raykv.engine.idle_steps; not in raykv_engine_tier_seconds)",
        ("node",),
    ),
    MetricSpec(
        "raykv_request_retries",
        HISTOGRAM,
        "RETRY answers raykv's tiers gave one request (observed when the request finishes)",
        ("node",),
        RETRY_BOUNDARIES,
    ),
    # -- engine side: per engine process's node and raykv namespace (raykv.integrations.vllm.drops)
    MetricSpec(
        "raykv_cascade_dropped_blocks",
        COUNTER,
        "blocks the engine computed that never reached vLLM's CPU primary (it was full), so no tier got them",
        ("node", "namespace"),
    ),
    # -- tier actors: per tier, node and holder (one object store actor per node, one fs actor per root)
    MetricSpec("raykv_tier_blocks", GAUGE, "blocks held by the tier actor", ACTOR_TAGS),
    MetricSpec("raykv_tier_bytes", GAUGE, "bytes of blocks held by the tier actor", ACTOR_TAGS),
    MetricSpec("raykv_tier_capacity_bytes", GAUGE, "byte capacity of the tier actor (0: unlimited)", ACTOR_TAGS),
    MetricSpec("raykv_tier_stored_blocks", COUNTER, "blocks the tier actor took in", ACTOR_TAGS),
    MetricSpec("raykv_tier_evicted_blocks", COUNTER, "blocks evicted to stay within capacity", ACTOR_TAGS),
    MetricSpec("raykv_tier_served_blocks", COUNTER, "blocks the tier actor copied to engines", ACTOR_TAGS),
    MetricSpec(
        "raykv_tier_load_misses",
        COUNTER,
        "blocks asked of the tier actor but not loaded (not held, or failed)",
        ACTOR_TAGS,
    ),
    MetricSpec("raykv_tier_removed_blocks", COUNTER, "blocks dropped as corrupt or missing", ACTOR_TAGS),
    MetricSpec(
        "raykv_tier_removed_files",
        COUNTER,
        "block files removed by reason (corrupt, missing, unreadable, misnamed); each is logged with its key "
        "and path (raykv.metrics.incidents)",
        (*ACTOR_TAGS, "reason"),
    ),
    MetricSpec("raykv_object_store_served_remote_blocks", COUNTER, "blocks handed to another node's actor", ACTOR_TAGS),
    # -- pins (raykv.core.pins): per tier actor; bytes and expiries also per tenant ("(none)": no tenant)
    MetricSpec("raykv_tier_pinned_blocks", GAUGE, "blocks the tier actor holds pinned (kept out of LRU)", ACTOR_TAGS),
    MetricSpec(
        "raykv_tier_pinned_bytes",
        GAUGE,
        "bytes the tier actor holds pinned for the tenant (they count against its quota)",
        (*ACTOR_TAGS, "tenant"),
    ),
    MetricSpec(
        "raykv_tier_pin_next_expiry_seconds",
        GAUGE,
        "seconds until the tenant's soonest pin on the tier actor expires, unless a request renews it",
        (*ACTOR_TAGS, "tenant"),
    ),
    MetricSpec(
        "raykv_tier_pins_refused",
        COUNTER,
        "blocks stored unpinned because a pin would pass a cap (reason: tier_cap, max_pinned_fraction of "
        "capacity; tenant_quota, max_pinned_fraction of the tenant's quota)",
        (*ACTOR_TAGS, "reason"),
    ),
    # -- request routers (raykv.serve.router), per Serve deployment
    MetricSpec(
        "raykv_router_decision_seconds",
        HISTOGRAM,
        "time the raykv request router spent choosing a replica (tokenize, hash, directory, rank)",
        ("deployment",),
        LATENCY_BOUNDARIES,
    ),
    MetricSpec(
        "raykv_router_decision_cpu_seconds",
        COUNTER,
        "CPU time of the raykv request router's thread in its decisions (its own work; the rest of "
        "raykv_router_decision_seconds is waiting for a core or for the event loop)",
        ("deployment",),
    ),
    MetricSpec(
        "raykv_router_stage_seconds",
        COUNTER,
        "time the raykv request router spent in each stage of its decisions (tokenize, hash, directory, rank)",
        ("deployment", "stage"),
    ),
    MetricSpec(
        "raykv_router_fallbacks",
        COUNTER,
        "decisions the raykv request router left to Serve's power of two choices, by reason: error (e.g. "
        "a directory read that failed or timed out) or unranked (no prompt, no engine layout known yet)",
        ("deployment", "reason"),
    ),
    MetricSpec(
        "raykv_router_prompt_tokens",
        COUNTER,
        "prompt tokens of routed requests by where the chosen replica should find them (engine, raykv, recompute)",
        ("deployment", "source"),
    ),
    # -- directory shards
    MetricSpec("raykv_directory_keys", GAUGE, "keys known to the directory shard", ("shard",)),
    MetricSpec("raykv_directory_holders", GAUGE, "holders (tier actors) known to the directory shard", ("shard",)),
    MetricSpec("raykv_directory_lookup_keys", COUNTER, "keys looked up at the directory shard", ("shard",)),
    MetricSpec(
        "raykv_directory_invalidations",
        COUNTER,
        "directory entries dropped (reason: evicted, or why the holder went: removed, restarted, ActorDiedError, ...)",
        ("shard", "reason"),
    ),
    # -- directory agents (one per node)
    MetricSpec(
        "raykv_agent_view_keys", GAUGE, "keys the node's directory view knows (held or known held by nobody)", ("node",)
    ),
    MetricSpec("raykv_agent_local_keys", GAUGE, "keys of the node's own holders in its directory view", ("node",)),
    MetricSpec(
        "raykv_agent_lag_seconds",
        HISTOGRAM,
        "replica lag: from a change at a directory shard to the node's view (the latest of each feed page)",
        ("node",),
        LATENCY_BOUNDARIES,
    ),
    MetricSpec("raykv_agent_engine_calls", COUNTER, "engine lookup calls the node's agent took", ("node",)),
    MetricSpec(
        "raykv_agent_shard_calls",
        COUNTER,
        "calls the node's agent made to directory shards "
        "(method: apply = one window's combined call, changes, holder_fingerprints)",
        ("node", "method"),
    ),
    MetricSpec(
        "raykv_agent_view_resets",
        GAUGE,
        "times the node's view forgot what it knew since its agent started (a shard's feed had a gap)",
        ("node",),
    ),
)

SPECS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}

_lock = threading.Lock()
#: A Ray metric object, by kind.
RayMetric = Counter | Gauge | Histogram
_created: dict[str, RayMetric] = {}


def exported_names() -> set[str]:
    """Every series name raykv can export (``ray_`` prefixed, as Prometheus sees it)."""
    return {n for spec in SPECS.values() for n in spec.exported_names()}


def metric(name: str) -> RayMetric | None:
    """The process's Ray metric object for ``name`` (None when Ray metrics are unavailable)."""
    spec = SPECS[name]  # KeyError: declare every metric in SPECS
    m = _created.get(name)
    if m is not None:
        return m
    with _lock:
        m = _created.get(name)
        if m is None:
            try:
                if not ray.is_initialized():
                    return None  # do not cache: Ray may connect later
                if spec.kind == COUNTER:
                    m = Counter(name, description=spec.description, tag_keys=spec.tag_keys)
                elif spec.kind == GAUGE:
                    m = Gauge(name, description=spec.description, tag_keys=spec.tag_keys)
                else:
                    m = Histogram(
                        name, description=spec.description, boundaries=list(spec.boundaries), tag_keys=spec.tag_keys
                    )
            except Exception as e:  # metrics are best effort
                logger.debug("metric %s unavailable: %r", name, e)
                return None
            _created[name] = m
    return m


def record(name: str, value: float, tags: Mapping[str, str]) -> None:
    """Add to (counter), set (gauge) or observe (histogram) ``name``; best effort, never raises."""
    m = metric(name)
    if m is None:
        return
    try:
        if isinstance(m, Counter):
            m.inc(value, tags=dict(tags))
        elif isinstance(m, Gauge):
            m.set(value, tags=dict(tags))
        else:
            m.observe(value, tags=dict(tags))
    except Exception as e:
        logger.debug("metric %s not recorded: %r", name, e)


def counter(name: str) -> Counter | None:
    """``metric(name)`` when it is a counter (None: unavailable)."""
    m = metric(name)
    return m if isinstance(m, Counter) else None


def histogram(name: str) -> Histogram | None:
    """``metric(name)`` when it is a histogram (None: unavailable)."""
    m = metric(name)
    return m if isinstance(m, Histogram) else None
