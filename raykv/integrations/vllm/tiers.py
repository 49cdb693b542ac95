"""vLLM ``SecondaryTierManager`` adapters over raykv's tiers.

Plug them into vLLM's tiering spec through ``secondary_tiers``::

    {"type": "RaykvObjectStoreTier", "module_path": "raykv.integrations.vllm.tiers", ...}
    {"type": "RaykvFsTier", "module_path": "raykv.integrations.vllm.tiers", "root": ...}

(``raykv.integrations.vllm.kv_transfer_config`` writes these entries from plain
raykv tier configs such as ``{"type": "fs", "root": ...}``.) The remaining keys
are the raykv tier's own options (``raykv.core.factory``), plus ``ray_address``,
``model_revision`` / ``weights_fingerprint`` (the engine's KV identity,
``raykv.integrations.vllm.identity``), ``identity`` (an explicit one) and
``kv_events`` (emit KV events; default: when vLLM's KV events are on).

vLLM builds the tier in its scheduler (EngineCore) process. The adapter
connects that process to Ray when it is not already (``ray_address``, else
``RAY_ADDRESS``, else ``auto``), attaches to the raykv services of the tier's
namespace (starting them when absent), and then only converts types: vLLM's
``ReqContext`` / ``TransferJob`` / ``JobResult`` / ``LookupResult`` /
``RequestOffloadingContext`` to and from raykv's, which carry the same fields.
Nothing here blocks the scheduler: the raykv tiers are non-blocking clients.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Collection, Iterable
from time import perf_counter_ns as _now
from typing import TYPE_CHECKING, ClassVar

from raykv.integrations.vllm import require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import (  # noqa: E402
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from raykv.core import contract  # noqa: E402
from raykv.core.factory import TierFactory  # noqa: E402
from raykv.core.identity import KVIdentity  # noqa: E402
from raykv.core.wire import JsonValue  # noqa: E402
from raykv.engine.pin_renewal import PinRenewals  # noqa: E402
from raykv.engine.reattach import TierReattach  # noqa: E402
from raykv.integrations.vllm import compat  # noqa: E402
from raykv.integrations.vllm.convert import (  # noqa: E402
    to_raykv_context,
    to_raykv_job,
    to_raykv_key,
    to_raykv_keys,
    to_vllm_events,
    to_vllm_lookup,
    to_vllm_request_context,
    to_vllm_results,
)
from raykv.integrations.vllm.identity import engine_identity, find_engine_config  # noqa: E402
from raykv.integrations.vllm.kv_events import EngineEventsBridge, connect_endpoint  # noqa: E402
from raykv.integrations.vllm.stats import TierStats  # noqa: E402
from raykv.metrics.step_cost import StepCost  # noqa: E402
from raykv.services.cluster import ensure_ray  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector  # 0.32+

__all__ = [
    "RaykvExampleTier",
    "RaykvFsTier",
    "RaykvObjectStoreTier",
    "RaykvTier",
    "engine_step_cost",
    "to_raykv_context",
]

logger = logging.getLogger(__name__)


#: Adapter options (not the raykv tier's); the kv_connector_extra_config
#: keys ``raykv_<name>`` give engine-wide defaults.
_IDENTITY_OPTIONS = ("model_revision", "weights_fingerprint")


#: One ``StepCost`` per engine: its tiers share the engine's ``offloading_spec``.
_ENGINE_COSTS: weakref.WeakKeyDictionary[OffloadingSpec, StepCost] = weakref.WeakKeyDictionary()


def engine_step_cost(offloading_spec: OffloadingSpec, node: str | None = None) -> StepCost:
    """The step meter of the engine that ``offloading_spec`` configures
    (one per engine, shared by its raykv tiers; ``raykv.metrics.step_cost``)."""
    try:
        cost = _ENGINE_COSTS.get(offloading_spec)
        if cost is None:
            cost = _ENGINE_COSTS[offloading_spec] = StepCost(node)
        return cost
    except TypeError:  # a spec that takes no weak reference: a meter of the tier's own
        return StepCost(node)


def _engine_config() -> object:
    """The building engine's ``VllmConfig`` (for its KV identity), or None, with a warning."""
    found = find_engine_config()
    if found is None:
        logger.warning(
            "raykv: the engine's vLLM config is out of reach here: its KV identity leaves out "
            "quantization, hf_overrides and the compute dtype, and it shares blocks only with "
            "engines built the same way"
        )
    return found


def _str_option(value: JsonValue) -> str | None:
    """An adapter option that names something (None when unset)."""
    return None if value is None or value == "" else str(value)


def forward_engine_events(
    offloading_spec: OffloadingSpec, raykv_tier: contract.SecondaryTier, raykv_type: str, tag: bytes
) -> EngineEventsBridge | None:
    """With vLLM's KV events on, record this engine's own cache in the
    directory (``raykv.holders.engine_cache``; for request routers). Where to read
    them: ``raykv_engine_events`` (``{"endpoint", "topic"}``) in the
    connector's extra config (``raykv.serve`` writes it), else vLLM's own
    ``kv_events_config`` when this process has it. One bridge per engine
    process, whichever tier asks first."""
    services = getattr(raykv_tier, "services", None)
    if services is None:
        return None
    extra = dict(getattr(offloading_spec, "extra_config", None) or {})
    where = extra.get("raykv_engine_events")
    endpoint: str | None
    if isinstance(where, dict) and where.get("endpoint"):
        endpoint, topic = str(where["endpoint"]), str(where.get("topic") or "")
    else:
        from vllm.config import get_current_vllm_config_or_none

        events_config = getattr(get_current_vllm_config_or_none(), "kv_events_config", None)
        endpoint = connect_endpoint(events_config)
        topic = str(getattr(events_config, "topic", "") or "")
    if not endpoint:
        return None
    bridge = EngineEventsBridge.start_for(services.config.namespace, endpoint, topic, tag)
    metrics = getattr(raykv_tier, "metrics", None)
    if metrics is not None:
        bridge.count_loads(raykv_type, lambda: metrics.totals.get("raykv_blocks_loaded", 0))
    return bridge


class RaykvTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a raykv tier (``raykv_type``).

    Every key is scoped with the engine's KV identity (``raykv.core.identity``),
    derived from the offloading spec: engines of other models, revisions,
    dtypes or layouts never see this engine's blocks.
    """

    raykv_type: ClassVar[str] = ""
    #: vLLM 0.33 may then call ``get_finished_jobs`` from its tier-poll thread
    #: between engine steps, so finished promotions are taken before the next
    #: step. Safe for raykv tiers: vLLM calls every tier method under its
    #: manager lock (never two at once), raykv keeps no per-thread state
    #: (results wait in a lock-protected ``JobTracker`` that I/O and control
    #: threads fill anyway), and nothing on that path blocks. Off on 0.34
    #: (``compat.OFF_THREAD_POLLING``: an idle engine would never stop stepping).
    tolerates_off_thread_polling: ClassVar[bool] = compat.OFF_THREAD_POLLING

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: JsonValue,
    ) -> None:
        compat.init_tier_manager(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        raykv_type = _str_option(options.pop("raykv_type", None)) or self.raykv_type
        module_path = _str_option(options.pop("raykv_module_path", None))
        if not raykv_type:
            raise ValueError(f"secondary tier {tier_type!r}: raykv_type is required for {type(self).__name__}")
        extra = dict(getattr(offloading_spec, "extra_config", None) or {})
        ident = {name: options.pop(name, extra.get(f"raykv_{name}")) for name in _IDENTITY_OPTIONS}
        explicit = options.pop("identity", None)
        kv_events = options.pop("kv_events", None)
        engine_cache = options.pop("engine_cache", True)
        if not isinstance(engine_cache, bool):
            raise ValueError(f"engine_cache: must be true or false, got {engine_cache!r}")
        ensure_ray(_str_option(options.pop("ray_address", None)) or os.environ.get("RAY_ADDRESS"), guest=True)
        if not compat.carry_cache_salt():
            logger.warning(
                "vLLM %s: request cache_salt does not reach raykv tiers (quotas by salt off)", compat.version()
            )
        self.identity: KVIdentity = (
            KVIdentity.from_dict(explicit, f"secondary_tiers[{tier_type}].identity")
            if explicit is not None
            else engine_identity(
                offloading_spec,
                chunk_bytes=(primary_kv_view.strides or (0,))[0],
                model_revision=ident["model_revision"],
                weights_fingerprint=ident["weights_fingerprint"] or "stat",
                engine_config=_engine_config(),
            )
        )
        config: dict[str, JsonValue] = {"type": raykv_type, **options}
        if module_path:
            config["module_path"] = module_path
        spec_config = getattr(offloading_spec, "config", None)
        if kv_events is None:
            kv_events = bool(getattr(spec_config, "enable_kv_cache_events", False))
        identity = self.identity

        def make_tier() -> contract.SecondaryTier:
            tier = TierFactory.create_tier(
                config, primary_kv_view, where=f"secondary_tiers[{tier_type}]", identity=identity
            )
            if kv_events and hasattr(tier, "enable_events"):
                tier.enable_events()
            return tier

        self.raykv_tier: contract.SecondaryTier = make_tier()
        #: After ``raykv stop`` then ``raykv start``: the same tier, attached anew.
        self.reattach = TierReattach(make_tier, f"{raykv_type} tier")
        if not compat.salt_tenant_requests(self.raykv_tier.tenant_sharing):
            logger.warning(
                "vLLM %s: a tenant label does not scope the engine's own prefix cache (use cache_salt)",
                compat.version(),
            )
        self.engine_events = (
            forward_engine_events(offloading_spec, self.raykv_tier, raykv_type, self.identity.tag)
            if engine_cache
            else None
        )
        self._stats = TierStats(tier_type)
        self._locality = Locality.LOCAL
        #: Requests with ``cache_ttl_s`` whose prompt keys this tier touches once listed.
        self.pin_renewals = PinRenewals()
        # raykv's time on the scheduler thread: every contract method below adds
        # its own to the engine's meter. A step ends at the last raykv tier's
        # on_schedule_end: vLLM 0.29-0.34 call every tier's once per scheduler
        # step (TieringOffloadingManager.on_schedule_end, from the connector's
        # build_connector_meta), in the order the tiers were built.
        self.step_cost = engine_step_cost(offloading_spec, getattr(self.raykv_tier, "node_id", None))
        self.step_cost.members.append(self)
        logger.info(
            "raykv %s tier attached to vLLM %s (%s), identity %s [%s]",
            raykv_type,
            compat.version(),
            tier_type,
            self.identity.label(),
            self.identity.tag_hex,
        )

    # -- contract ------------------------------------------------------------
    # Each method adds its time to the engine's step meter (two clock reads;
    # ``raykv.metrics.step_cost``): that sum per step is raykv's cost on the scheduler thread.
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        t0 = _now()
        try:
            return to_vllm_lookup(self.raykv_tier.lookup(to_raykv_key(key), to_raykv_context(req_context)))
        finally:
            self.step_cost.ns += _now() - t0

    def submit_store(self, job_metadata: TransferJob) -> None:
        t0 = _now()
        try:
            self.raykv_tier.submit_store(to_raykv_job(job_metadata))
        finally:
            self.step_cost.ns += _now() - t0

    def submit_load(self, job_metadata: TransferJob) -> None:
        t0 = _now()
        try:
            self.raykv_tier.submit_load(to_raykv_job(job_metadata))
        finally:
            self.step_cost.ns += _now() - t0

    def get_finished_jobs(self) -> Iterable[JobResult]:
        t0 = _now()
        try:
            results = self.raykv_tier.get_finished_jobs()
            if self.reattach.has_pending_work():  # a tier replaced after a raykv restart: its jobs end too
                results = [*results, *self.reattach.finished_jobs()]
            return to_vllm_results(results)
        finally:
            self.step_cost.ns += _now() - t0

    def has_pending_work(self) -> bool:
        t0 = _now()
        try:
            return self.raykv_tier.has_pending_work() or self.reattach.has_pending_work()
        finally:
            self.step_cost.ns += _now() - t0

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        t0 = _now()
        try:
            self.raykv_tier.touch(to_raykv_keys(keys), to_raykv_context(req_context))
        finally:
            self.step_cost.ns += _now() - t0

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        t0 = _now()
        try:
            ctx = to_raykv_context(req_context)
            self.pin_renewals.add(ctx)  # vLLM never calls touch: a TTL request's pins renew here
            return to_vllm_request_context(self.raykv_tier.on_new_request(ctx))
        finally:
            self.step_cost.ns += _now() - t0

    def on_request_finished(self, req_context: ReqContext) -> None:
        t0 = _now()
        try:
            ctx = to_raykv_context(req_context)
            self.raykv_tier.on_request_finished(ctx)
            self.step_cost.request_finished(ctx)  # its RETRYs, once per request
        finally:
            self.step_cost.ns += _now() - t0

    def on_schedule_end(self, context: ScheduleEndContext | None = None) -> None:
        cost = self.step_cost
        t0 = _now()
        try:
            if self.pin_renewals:
                for ctx, keys in self.pin_renewals.due():
                    self.raykv_tier.touch(keys, ctx)
            self.raykv_tier.on_schedule_end()
            replacement = self.reattach.poll(self.raykv_tier)
            if replacement is not None:
                self._attach(replacement)
        finally:
            cost.ns += _now() - t0
            if cost.closer is self:
                cost.step_end()

    def drain_jobs(self) -> None:
        t0 = _now()
        try:
            self.raykv_tier.drain_jobs()
        finally:
            self.step_cost.ns += _now() - t0

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks of this engine's identity that the tier started or stopped
        holding (vLLM publishes them to its KV-event consumers)."""
        t0 = _now()
        try:
            # vLLM's event publisher needs a medium: an out-of-tree tier without one reports CPU.
            medium = self.medium if self.medium is not None else Medium.CPU
            return to_vllm_events(self.raykv_tier.take_events(), medium, self._locality, self.tier_type)
        finally:
            self.step_cost.ns += _now() - t0

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, object]) -> dict[str, OffloadingMetricMetadata]:
        """raykv's per-tier series in vLLM's own metrics (``vllm:raykv_*``)."""
        return TierStats.definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What this tier counted since the last call, as vLLM connector stats;
        the engine's step and request costs ride with its last raykv tier's."""
        t0 = _now()
        cost = self.step_cost
        try:
            return self._stats.take(getattr(self.raykv_tier, "metrics", None), cost if cost.closer is self else None)
        finally:
            cost.ns += _now() - t0

    def shutdown(self) -> None:
        cost = self.step_cost
        if self in cost.members:
            cost.members.remove(self)
        cost.export()  # what the last second measured
        if self.engine_events is not None:
            self.engine_events.stop()
        self.reattach.shutdown()
        self.raykv_tier.shutdown()

    def _attach(self, tier: contract.SecondaryTier) -> None:
        """Use ``tier``, built anew after raykv restarted (``raykv.engine.reattach``);
        the engine's own-cache entries go to a new actor at the new directory."""
        self.raykv_tier = tier
        if self.engine_events is not None:
            self.engine_events.replace_actor()


class RaykvObjectStoreTier(RaykvTier):
    """Blocks in the Ray object store, owned by one raykv actor per node."""

    raykv_type = "object_store"
    medium = Medium.CPU


class RaykvFsTier(RaykvTier):
    """Blocks as checksummed files on shared storage (path or ``pyarrow.fs`` URI)."""

    raykv_type = "fs"
    medium = Medium.STORAGE


class RaykvExampleTier(RaykvTier):
    """raykv's in-memory reference tier (tests and examples)."""

    raykv_type = "example"
    medium = Medium.CPU
