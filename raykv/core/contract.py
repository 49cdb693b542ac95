"""The secondary-tier contract, name-compatible with vLLM's ``kv_offload``.

raykv keeps its own copies of these types so the core needs no vLLM; the vLLM
adapters (``raykv.integrations.vllm``) translate at the boundary.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np

from raykv.core.identity import DEFAULT_IDENTITY, KVIdentity
from raykv.core.keys import OffloadKey
from raykv.core.tenants import ISOLATED, TenantSharing, tenant_key
from raykv.core.validate import ConfigError

JobId = int


class LookupResult(Enum):
    """Answer of ``SecondaryTier.lookup`` for one key."""

    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()  # present, not yet readable
    RETRY = auto()  # ask again next step (an async lookup is in flight)


class OffloadPolicy(Enum):
    """How much of a request a tier wants offloaded."""

    CHUNK_LEVEL = "chunk_level"  # only newly computed chunks
    BLOCK_LEVEL = "chunk_level"  # alias used by the seed docs
    REQUEST_LEVEL = "request_level"  # also chunks that were prefix hits

    @classmethod
    def parse(cls, value: "str | OffloadPolicy") -> "OffloadPolicy":
        """Accept an enum, its value or its name (any case)."""
        if isinstance(value, OffloadPolicy):
            return value
        text = str(value).strip().lower()
        for member in cls:
            if text in (member.value, member.name.lower()):
                return member
        if text == "block_level":
            return cls.CHUNK_LEVEL
        raise ValueError(f"unknown offload policy {value!r}; allowed: chunk_level, block_level, request_level")


@dataclass
class ReqContext:
    """Per-request context handed to every tier call."""

    req_id: str
    kv_transfer_params: Mapping[str, object] | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    #: Seconds to pin the request's blocks in the tiers past LRU
    #: (``kv_transfer_params['cache_ttl_s']``; ``raykv.core.pins``). None: unpinned.
    cache_ttl_s: float | None = field(default=None, compare=False)
    #: The request's offload keys in prefix order, when the engine knows them
    #: (vLLM records them before its lookups): directory-backed tiers resolve
    #: them in one call at the request's first lookup.
    prefix_keys: Callable[[], Sequence[bytes]] | None = field(default=None, repr=False, compare=False)
    #: Set by a tier once it resolved this request's prefix (one wait per request).
    prefix_resolved: bool = field(default=False, repr=False, compare=False)
    #: RETRY answers this request got from raykv's tiers (all tiers; ``raykv.metrics.step_cost``).
    retries: int = field(default=0, repr=False, compare=False)
    #: This request's RETRY budget in seconds (None: the namespace's
    #: ``lookup_retry_budget_ms``; ``TierDriver`` waits out its own timeout instead).
    retry_budget_s: float | None = field(default=None, repr=False, compare=False)
    #: When the request's current run of RETRY steps began (monotonic s), and
    #: the lookup round (``LookupCache.round``) of its last RETRY.
    retry_since: float | None = field(default=None, repr=False, compare=False)
    retry_round: int = field(default=-2, repr=False, compare=False)
    #: Set once its RETRY count went to the step meter (``StepCost.request_finished``).
    cost_reported: bool = field(default=False, repr=False, compare=False)
    #: Compute once (``raykv.engine.pending``): set once this request announced the
    #: blocks it computes; until when it waits for blocks another engine computes
    #: (monotonic s; None: it has not met any), and whether that wait was counted.
    pending_announced: bool = field(default=False, repr=False, compare=False)
    pending_wait_until: float | None = field(default=None, repr=False, compare=False)
    #: The latest it waits while the other engine's entries still live (monotonic s).
    pending_wait_live_until: float | None = field(default=None, repr=False, compare=False)
    pending_wait_extended: bool = field(default=False, repr=False, compare=False)
    pending_wait_ended: bool = field(default=False, repr=False, compare=False)
    pending_loaded: bool = field(default=False, repr=False, compare=False)
    #: When the entries it waits for were first seen gone without their blocks (monotonic s).
    pending_gone_at: float | None = field(default=None, repr=False, compare=False)
    #: The scoped keys it announced; its claim on the first of them (the shard's
    #: answer: other engines that claimed it first), and how long it waits for it.
    pending_keys: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    #: The scoped keys it computes unlisted (``short``): timed only, forgotten at its end.
    pending_timed_keys: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    pending_claim: Future[int] | None = field(default=None, repr=False, compare=False)
    pending_claim_until: float | None = field(default=None, repr=False, compare=False)


@dataclass
class RequestOffloadingContext:
    """What ``on_new_request`` returns: the policy and who asked for it."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL
    request_level_tiers: frozenset[str] = frozenset()


@dataclass
class TransferJob:
    """An async store (primary -> tier) or load (tier -> primary)."""

    job_id: JobId
    keys: Collection[OffloadKey]
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext
    submit_time: float = field(default_factory=time.monotonic)


@dataclass
class JobResult:
    """Outcome of one job; every submitted job ends in exactly one."""

    job_id: JobId
    success: bool
    # For loads: the keys that did load when some failed (None: all share `success`).
    successful_keys: Collection[OffloadKey] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    error: str | None = None
    #: For a failed load whose copy may still be running: set once nothing can write
    #: the job's primary chunks any more (vLLM 0.34+ keeps them out of use until then).
    deferred_release: threading.Event | None = None


@dataclass
class TierEvent:
    """Blocks (the engine's own, unscoped keys) that a tier started or stopped holding."""

    keys: list[OffloadKey]
    removed: bool


def check_primary_holds_a_block(primary_kv_view: memoryview) -> None:
    """``ConfigError`` naming ``cpu_bytes_to_use`` when the primary has no chunk.

    vLLM sizes its CPU primary as ``cpu_bytes_to_use // chunk bytes``: 0 chunks
    when cpu_bytes is below one block. raykv's spec refuses that first; vLLM's
    own spec builds an empty primary, from which nothing could be offloaded."""
    shape, strides = primary_kv_view.shape, primary_kv_view.strides
    if shape is not None and strides is not None and len(shape) == 2 and shape[0] < 1:
        size = strides[0]
        raise ConfigError(
            "cpu_bytes_to_use",
            f"the CPU primary holds no KV block ({size} bytes each): give it at least {size} bytes "
            "(cpu_bytes), better many blocks",
        )


class SecondaryTier(ABC):
    """A secondary KV tier as seen from an engine's scheduler process.

    Threading: every method is called from the engine's scheduler thread (on
    vLLM >= 0.33 some also from its tier-poll thread, under the tiering
    manager's lock: never two at once). None may block on I/O: submits hand
    work to another thread or process, and completions come back through
    ``get_finished_jobs``. ``drain_jobs`` and ``shutdown`` are the only calls
    that may wait.

    Keys: ``OffloadKey`` bytes (block hash + 4-byte group index) as the
    engine names them; a tier scopes them with the engine's KV identity and
    the request's tenant (``scope``) before they leave the process, so engines
    of different models or layouts, and tenants that do not share
    (``raykv.core.tenants``), never meet.

    Slots: a job's ``chunk_ids`` index the first axis of ``primary_kv_view``
    (``num_chunks`` rows of ``block_size_bytes``). The engine does not touch a
    job's slots until the job's result is out of ``get_finished_jobs``, and
    may reuse them at once after that: a tier must never write a slot after
    reporting the job.

    Results: every submitted job ends in exactly one ``JobResult`` (success,
    or failure with ``error`` and, for loads, the ``successful_keys`` that did
    load), however it ends: errors, dead actors, timeouts and ``shutdown``
    included. A job that never reports is a hang.
    """

    #: "plasma" (node-local memory) or "shared" (shared storage).
    medium: str = "plasma"

    def __init__(
        self, primary_kv_view: memoryview, tier_type: str, identity: KVIdentity | Mapping[str, object] | None = None
    ) -> None:
        shape, strides = primary_kv_view.shape, primary_kv_view.strides
        if shape is None or strides is None or len(shape) != 2:
            raise ValueError(f"primary_kv_view must be 2-D (num_chunks, bytes_per_chunk), got shape {shape}")
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type
        self.block_size_bytes: int = strides[0]
        self.num_chunks: int = shape[0]
        check_primary_holds_a_block(primary_kv_view)
        #: The engine's KV identity; every key this tier stores or looks up
        #: is scoped with its tag (``raykv.core.identity``).
        self.identity: KVIdentity = KVIdentity.from_dict(identity) if identity is not None else DEFAULT_IDENTITY
        self.key_tag: bytes = self.identity.tag
        #: Which tenants share blocks (``raykv.core.tenants``; namespace config ``shared_tenants``).
        self.tenant_sharing: TenantSharing = ISOLATED

    @property
    def primary_kv_view(self) -> memoryview:
        """The engine's primary region, ``(num_chunks, block_size_bytes)``."""
        return self._primary_kv_view

    def key_scope(self, req_context: ReqContext | None) -> bytes:
        """The tenant scope of ``req_context``'s keys (b"": plain keys; ``raykv.core.tenants``)."""
        return self.tenant_sharing.scope(req_context)

    def scope(self, key: bytes, req_context: ReqContext | None = None, *, scope: bytes | None = None) -> bytes:
        """The key raykv stores for the engine's ``key``: identity tag, then
        the key in the request's tenant scope (``scope``: one computed already)."""
        if scope is None:
            scope = self.tenant_sharing.scope(req_context)
        return self.key_tag + (tenant_key(key, scope) if scope else key)

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether this tier can load ``key`` for ``req_context``'s request.

        Never blocks: an answer that needs the network returns ``RETRY`` and
        is asked again next step. ``HIT`` is a promise the tier expects to
        keep, not a guarantee: a load of a key whose block vanished since
        fails that key (``successful_keys``) and the engine recomputes it.
        A malformed key is a ``MISS``, never an exception.
        """

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Start copying ``job.keys`` from primary slots ``job.chunk_ids`` into the tier.

        Returns at once; never raises (a bad job becomes a failed result).
        Keys the tier already holds count as stored. Success means every key
        is readable by later lookups and loads, from any engine of the same
        identity the tier reaches.
        """

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Start copying ``job.keys`` from the tier into primary slots ``job.chunk_ids``.

        Returns at once; never raises. Keys succeed or fail one by one: a
        partial load reports ``success=False`` with the keys that did load in
        ``successful_keys``; their slots hold exactly the stored bytes.
        """

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Results of jobs finished since the last call (each job once); never blocks."""

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """The offload policy this tier wants for a new request (from memory: no remote call)."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Release per-request state; jobs may still be in flight."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark keys as recently used for eviction (best effort, never blocks)."""

    def on_schedule_end(self) -> None:
        """Once per scheduler step: flush batched work (e.g. directory lookups)."""

    def has_pending_work(self) -> bool:
        """Whether the engine should keep stepping to let this tier progress
        (jobs in flight, lookups awaiting an answer)."""
        return False

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has a result queued (jobs that
        cannot finish in time are failed, never dropped)."""

    def take_events(self) -> list["TierEvent"]:
        """Stored / removed blocks of this engine's identity since the last
        call (the engine's own, unscoped keys); never blocks."""
        return []

    def shutdown(self) -> None:
        """Release threads and connections; in-flight jobs end in failed
        results. Blocks held by tier actors outlive the engine."""
