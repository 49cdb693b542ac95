"""The secondary-tier contract, name-compatible with vLLM's ``kv_offload``.

raykv keeps its own copies of these types so the core needs no vLLM; the vLLM
adapters (``raykv.integrations.vllm``) translate at the boundary.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import numpy as np

from raykv.identity import DEFAULT_IDENTITY, KVIdentity
from raykv.keys import OffloadKey

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
        raise ValueError(
            f"unknown offload policy {value!r}; allowed: chunk_level, block_level, request_level"
        )


@dataclass
class ReqContext:
    """Per-request context handed to every tier call."""

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    #: The request's offload keys in prefix order, when the engine knows them
    #: (vLLM records them before its lookups): directory-backed tiers resolve
    #: them in one call at the request's first lookup.
    prefix_keys: Callable[[], Sequence[bytes]] | None = field(default=None, repr=False, compare=False)
    #: Set by a tier once it resolved this request's prefix (one wait per request).
    prefix_resolved: bool = field(default=False, repr=False, compare=False)


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


@dataclass
class TierEvent:
    """Blocks (the engine's own, unscoped keys) that a tier started or stopped holding."""

    keys: list[OffloadKey]
    removed: bool


class SecondaryTier(ABC):
    """A secondary KV tier as seen from an engine's scheduler process.

    Every method is called from the scheduler thread and must not block on
    I/O: submits hand work to another thread or process, and completions come
    back through ``get_finished_jobs``.
    """

    #: "plasma" (node-local memory) or "shared" (shared storage).
    medium: str = "plasma"

    def __init__(
        self, primary_kv_view: memoryview, tier_type: str, identity: "KVIdentity | Mapping[str, Any] | None" = None
    ) -> None:
        if primary_kv_view.ndim != 2:
            raise ValueError(
                "primary_kv_view must be 2-D (num_chunks, bytes_per_chunk), "
                f"got shape {primary_kv_view.shape}"
            )
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type
        self.block_size_bytes: int = primary_kv_view.strides[0]
        self.num_chunks: int = primary_kv_view.shape[0]
        #: The engine's KV identity; every key this tier stores or looks up
        #: is scoped with its tag (``raykv.identity``).
        self.identity: KVIdentity = KVIdentity.from_dict(identity) if identity is not None else DEFAULT_IDENTITY
        self.key_tag: bytes = self.identity.tag

    def scope(self, key: bytes) -> bytes:
        """The identity-scoped key raykv stores for the engine's ``key``."""
        return self.key_tag + key

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None: ...

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None: ...

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]: ...

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Release per-request state; jobs may still be in flight."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark keys as recently used for eviction."""

    def on_schedule_end(self) -> None:
        """Once per scheduler step: flush batched work (e.g. directory lookups)."""

    def has_pending_work(self) -> bool:
        """Whether the engine should keep stepping to let this tier progress."""
        return False

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has a result queued."""

    def take_events(self) -> list["TierEvent"]:
        """Stored / removed blocks of this engine's identity since the last call."""
        return []

    def shutdown(self) -> None:
        """Release threads and connections."""
