"""vLLM's offloading types to raykv's (``raykv.core.contract``) and back.

Both sides carry the same fields: a request's context, a transfer job, a
job's result, a lookup answer, a request's offload policy and a tier's
events. Keys are the same bytes on both sides (each names its own
``OffloadKey`` type). ``raykv.integrations.vllm.tiers`` calls these for
every tier method.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import cast

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from raykv.core import contract
from raykv.core import keys as raykv_keys
from raykv.core.validate import request_params, request_tenant_value, request_ttl_value
from raykv.integrations.vllm import compat

_LOOKUP = {r.name: LookupResult[r.name] for r in contract.LookupResult}
_POLICY = {
    contract.OffloadPolicy.CHUNK_LEVEL: compat.CHUNK_LEVEL,
    contract.OffloadPolicy.REQUEST_LEVEL: OffloadPolicy.REQUEST_LEVEL,
}


def to_raykv_key(key: OffloadKey) -> raykv_keys.OffloadKey:
    """vLLM's offload key as raykv's (the same bytes: both are ``NewType``s of bytes)."""
    return cast("raykv_keys.OffloadKey", key)


def to_raykv_keys(keys: Collection[OffloadKey]) -> Collection[raykv_keys.OffloadKey]:
    """vLLM's offload keys as raykv's (the same bytes: both are ``NewType``s of bytes)."""
    return cast("Collection[raykv_keys.OffloadKey]", keys)


def to_raykv_context(ctx: ReqContext) -> contract.ReqContext:
    """raykv's view of a vLLM request; made once per request and kept in the
    request's state (vLLM's public ``get_state`` / ``set_state``).

    The tenant comes from ``kv_transfer_params["tenant"]`` (it scopes the
    request's keys: ``raykv.core.tenants``), else from the request's ``cache_salt``
    (vLLM mixes it into its block hashes already; it reaches the tier through
    ``compat.carry_cache_salt`` where vLLM's ``ReqContext`` lacks it). The
    pin lifetime comes from ``kv_transfer_params["cache_ttl_s"]`` (seconds
    > 0, at most 7 days; a malformed one is ignored with a warning:
    ``raykv.core.validate.request_ttl_value``); a tenant that is not a str or an
    int is the one its JSON text names (``request_tenant_value``). Odd
    ``kv_transfer_params`` (not a dict) are treated as none.
    """
    cached = ctx.get_state(contract.ReqContext)
    if cached is not None:
        return cached
    params = request_params(ctx.kv_transfer_params)  # a mapping or None, whatever the request sent
    salt = compat.request_salt(ctx)
    positions = compat.request_key_positions(ctx)
    out = contract.ReqContext(
        req_id=ctx.req_id,
        kv_transfer_params=params,
        tenant=request_tenant_value(params.get("tenant")) if params else None,
        cache_ttl_s=request_ttl_value(params.get("cache_ttl_s")) if params else None,
        prefix_keys=(lambda: list(positions)) if positions is not None else None,
        cache_salt=salt,
    )
    ctx.set_state(out)
    return out


def to_raykv_job(job: TransferJob) -> contract.TransferJob:
    """A vLLM transfer job as raykv's (its request context converted once per request)."""
    return contract.TransferJob(
        job_id=job.job_id,
        keys=to_raykv_keys(job.keys),
        chunk_ids=compat.job_slots(job),
        is_promotion=job.is_promotion,
        req_context=to_raykv_context(job.req_context),
        submit_time=getattr(job, "submit_time", None) or time.monotonic(),
    )


def to_vllm_results(results: Iterable[contract.JobResult]) -> list[JobResult]:
    """raykv's finished jobs as vLLM's ``JobResult``s (with the fields this release has)."""
    return [
        compat.job_result(
            job_id=r.job_id,
            success=r.success,
            successful_keys=r.successful_keys,
            transfer_time=r.transfer_time,
            transfer_bytes=r.transfer_bytes,
            deferred_release=r.deferred_release,
        )
        for r in results
    ]


def to_vllm_lookup(result: contract.LookupResult) -> LookupResult:
    return _LOOKUP[result.name]


def to_vllm_request_context(decided: contract.RequestOffloadingContext) -> RequestOffloadingContext:
    """The offload policy a tier chose for a request, in vLLM's enum."""
    return RequestOffloadingContext(policy=_POLICY[decided.policy])


def to_vllm_events(
    events: Iterable[contract.TierEvent], medium: Medium, locality: Locality, ownership: str
) -> list[OffloadingEvent]:
    """A tier's events (blocks it started or stopped holding) as vLLM's, for its KV-event consumers."""
    return [
        OffloadingEvent(
            keys=cast("list[OffloadKey]", list(e.keys)),  # the same bytes
            medium=medium,
            removed=e.removed,
            locality=locality,
            ownership=ownership,
        )
        for e in events
    ]
