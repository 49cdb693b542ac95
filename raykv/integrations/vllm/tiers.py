"""vLLM ``SecondaryTierManager`` adapters over raykv's tiers.

Plug them into vLLM's tiering spec through ``secondary_tiers``::

    {"type": "RaykvObjectStoreTier", "module_path": "raykv.integrations.vllm.tiers", ...}
    {"type": "RaykvFsTier", "module_path": "raykv.integrations.vllm.tiers", "root": ...}

(``raykv.integrations.vllm.kv_transfer_config`` writes these entries from plain
raykv tier configs such as ``{"type": "fs", "root": ...}``.) The remaining keys
are the raykv tier's own options (``raykv.factory``), plus ``ray_address``.

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
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from raykv.integrations.vllm import require_vllm

require_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (  # noqa: E402
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from raykv import contract  # noqa: E402
from raykv.cluster import ensure_ray  # noqa: E402
from raykv.factory import TierFactory  # noqa: E402

logger = logging.getLogger(__name__)


_LOOKUP = {r.name: LookupResult[r.name] for r in contract.LookupResult}
_POLICY = {contract.OffloadPolicy.CHUNK_LEVEL: OffloadPolicy.CHUNK_LEVEL,
           contract.OffloadPolicy.REQUEST_LEVEL: OffloadPolicy.REQUEST_LEVEL}


def to_raykv_context(ctx: ReqContext) -> contract.ReqContext:
    """raykv's view of a vLLM request; made once per request and cached on it.

    The tenant comes from ``kv_transfer_params["tenant"]``; vLLM already
    mixes the request's ``cache_salt`` into its block hashes (so keys differ
    per tenant without raykv's help).
    """
    state = getattr(ctx, "_state", None)
    if state is not None:
        cached = state.get(contract.ReqContext)
        if cached is not None:
            return cached
    params = ctx.kv_transfer_params or None
    tenant = params.get("tenant") if isinstance(params, dict) else None
    salt = getattr(ctx, "cache_salt", None)  # not on vLLM 0.32's ReqContext; used where a version has it
    out = contract.ReqContext(
        req_id=ctx.req_id,
        kv_transfer_params=params,
        tenant=str(tenant) if tenant is not None else None,
        cache_salt=str(salt) if salt is not None else None,
    )
    if state is not None:
        state[contract.ReqContext] = out
    return out


class RaykvTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a raykv tier (``raykv_type``)."""

    raykv_type: ClassVar[str] = ""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        try:
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        except TypeError:  # vLLM releases without backpressure detectors
            super().__init__(offloading_spec, primary_kv_view, tier_type)  # type: ignore[call-arg]
        raykv_type = options.pop("raykv_type", None) or self.raykv_type
        module_path = options.pop("raykv_module_path", None)
        if not raykv_type:
            raise ValueError(f"secondary tier {tier_type!r}: raykv_type is required for {type(self).__name__}")
        ensure_ray(options.pop("ray_address", None) or os.environ.get("RAY_ADDRESS"))
        config = {"type": raykv_type, **options}
        if module_path:
            config["module_path"] = module_path
        self.raykv_tier: contract.SecondaryTier = TierFactory.create_tier(
            config, primary_kv_view, where=f"secondary_tiers[{tier_type}]"
        )
        logger.info("raykv %s tier attached to vLLM (%s)", raykv_type, tier_type)

    # -- contract ------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self.raykv_tier.lookup(key, to_raykv_context(req_context)).name]

    def submit_store(self, job_metadata: TransferJob) -> None:
        self.raykv_tier.submit_store(self._job(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self.raykv_tier.submit_load(self._job(job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [
            JobResult(
                job_id=r.job_id,
                success=r.success,
                successful_keys=r.successful_keys,
                transfer_time=r.transfer_time,
                transfer_bytes=r.transfer_bytes,
            )
            for r in self.raykv_tier.get_finished_jobs()
        ]

    def has_pending_work(self) -> bool:
        return self.raykv_tier.has_pending_work()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.raykv_tier.touch(keys, to_raykv_context(req_context))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        decided = self.raykv_tier.on_new_request(to_raykv_context(req_context))
        return RequestOffloadingContext(policy=_POLICY[decided.policy])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.raykv_tier.on_request_finished(to_raykv_context(req_context))

    def on_schedule_end(self, context: Any = None) -> None:
        self.raykv_tier.on_schedule_end()

    def drain_jobs(self) -> None:
        self.raykv_tier.drain_jobs()

    def shutdown(self) -> None:
        self.raykv_tier.shutdown()

    @staticmethod
    def _job(job: TransferJob) -> contract.TransferJob:
        return contract.TransferJob(
            job_id=job.job_id,
            keys=job.keys,
            chunk_ids=job.chunk_ids,
            is_promotion=job.is_promotion,
            req_context=to_raykv_context(job.req_context),
            submit_time=job.submit_time,
        )


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
