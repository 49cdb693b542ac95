"""``ObjectStoreTier``: the engine-side client of the node's object store actor.

Runs in the engine's scheduler process and never blocks it: a store or load
job is one actor call (``.remote()``) to this node's ``ObjectStoreActor``,
carrying keys, chunk ids and the primary region's ``RegionHandle`` (never
block bytes: the actor maps the region itself). ``poll_jobs`` turns finished
calls into exactly one ``JobResult`` each with ``ray.wait(timeout=0)``; a
dead actor, an exception or a job past ``job_timeout_s`` becomes a failed
result, and a load where some keys were missing or evicted reports the keys
that did load.

Which keys it serves: those whose chosen holder (``raykv.placement``: this
node's plasma, then shared storage the engine reads, then another node's
plasma) is an object store actor. Cross-node loads are still one call to the local actor, which
asks the holder's actor for ObjectRefs and pulls them through Ray's object
manager.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import ray

from raykv.cluster import RaykvServices
from raykv.config import namespace_option, opt
from raykv.contract import ReqContext, TransferJob
from raykv.placement import PLASMA, HolderInfo
from raykv.errors import RaykvError
from raykv.keys import OffloadKey
from raykv.primary import RegionHandle, describe_region
from raykv.identity import KVIdentity
from raykv.tenants import tenant_of, tenant_quotas_option
from raykv.actor_tier import DirectoryBackedTier
from raykv.polling import ActorLiveness
from tiers.object_store import packing
from tiers.object_store.actor import TIER_TYPE, holder_info, start_actor

logger = logging.getLogger(__name__)

GiB = 1024**3
MiB = 1024**2

#: Slack between the actor's copy deadline and the tier's job timeout.
DEADLINE_GRACE_S = 2.0



def _check_fraction(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else f"must be in (0, 1], got {value!r}"


@dataclass
class ObjectStoreOptions:
    namespace: str = namespace_option()
    capacity_bytes: int = opt(
        1 * GiB,
        kind=int,
        min=0,
        doc="bytes of blocks each node's actor keeps in plasma (LRU by pack); 0 stores nothing. "
        "Set when a node's actor starts; capped at max_object_store_fraction of the node's object store",
    )
    max_object_store_fraction: float = opt(
        0.8, kind=float, check=_check_fraction, doc="largest share of a node's object store the tier may use"
    )
    max_pack_bytes: int = opt(
        64 * MiB,
        kind=int,
        min=1,
        doc="largest plasma object: a store job's blocks are packed into objects of at most this many bytes "
        "(bigger objects pull faster across nodes; smaller ones evict at a finer grain)",
    )
    piece_bytes: int = opt(
        packing.PIECE_BYTES,
        kind=int,
        min=4096,
        doc="largest buffer handed to ray.put inside a pack (Ray copies buffers over 1 MiB with per-call threads)",
    )
    job_timeout_s: float = opt(
        60.0, kind=float, min=0.1, max=86400.0, doc="a job whose actor call has not answered by then fails"
    )
    tenant_quotas: dict = tenant_quotas_option("bytes of blocks on each node", "Set when a node's actor starts")

    def actor_settings(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "max_object_store_fraction": self.max_object_store_fraction,
            "max_pack_bytes": self.max_pack_bytes,
            "piece_bytes": self.piece_bytes,
            "remote_timeout_s": max(0.1, self.job_timeout_s / 2),
            "tenant_quotas": dict(self.tenant_quotas),
        }


@dataclass
class _InFlight:
    kind: str  # "store" or "load"
    job: TransferJob
    keys: list[bytes]
    deadline: float  # monotonic


class ObjectStoreTier(DirectoryBackedTier):
    """KV blocks in the Ray object store, owned by one actor per node."""

    Options = ObjectStoreOptions
    medium = PLASMA

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        options: ObjectStoreOptions,
        services: RaykvServices | None = None,
        identity: KVIdentity | None = None,
        **_: Any,
    ) -> None:
        try:
            region = describe_region(primary_kv_view)
        except ValueError as e:
            raise ValueError(f"object_store tier: {e}") from e
        super().__init__(primary_kv_view, tier_type, options.namespace, services, identity)
        self.options = options
        self.region: RegionHandle = dataclasses.replace(region, node_id=self.node_id)
        self.holder_info: HolderInfo = holder_info(self.node_id, self.services.namespace)
        self.holder_id = self.holder_info.holder_id
        self.actor = self.ensure_actor(self.services, options, self.node_id)
        self._lock = threading.Lock()
        self._inflight: dict[ray.ObjectRef, _InFlight] = {}
        self._touches: dict[bytes, None] = {}
        self._closed = False
        self.liveness = ActorLiveness(self.actor, f"object store actor of node {self.node_id}")

    # -- services ------------------------------------------------------------
    @classmethod
    def ensure_actor(cls, services: RaykvServices, options: ObjectStoreOptions, node_id: str, timeout: float = 120.0) -> Any:
        """Start (or find) ``node_id``'s object store actor and wait until it is ready."""
        actor = start_actor(node_id, services.namespace, options.actor_settings())
        cls.start_holder_actor(actor, f"object_store tier: the actor of node {node_id}", options.capacity_bytes, timeout)
        return actor

    @classmethod
    def start_services(cls, services: RaykvServices, options: ObjectStoreOptions) -> list[Any]:
        """Start one object store actor per alive node; returns their handles."""
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        actors = [start_actor(node, services.namespace, options.actor_settings()) for node in nodes]
        try:
            ray.get([a.ready.remote() for a in actors], timeout=120)
        except Exception as e:
            raise RaykvError(f"object_store tier: node actors did not start: {e}") from e
        return actors

    # -- contract ------------------------------------------------------------
    def can_load(self, holder: HolderInfo) -> bool:
        """Any node's object store actor, through this node's (alive) actor."""
        return holder.tier_type == TIER_TYPE and holder.medium == PLASMA and self.liveness.alive

    def submit_store(self, job: TransferJob) -> None:
        def call(keys: list[bytes], chunks: list[int], timeout: float) -> ray.ObjectRef:
            return self.actor.store.remote(job.job_id, self.region, keys, chunks, tenant_of(job.req_context))

        self._send("store", job, call)

    def submit_load(self, job: TransferJob) -> None:
        def call(keys: list[bytes], chunks: list[int], timeout: float) -> ray.ObjectRef:
            # The copy must not land after we gave up on the job (the engine
            # may reuse the slots): the actor checks this deadline.
            deadline = time.time() + max(0.05, timeout - DEADLINE_GRACE_S)
            return self.actor.load.remote(job.job_id, self.region, keys, chunks, self._sources(keys), deadline)

        self._send("load", job, call)

    def _send(self, kind: str, job: TransferJob, call: Callable[[list[bytes], list[int], float], ray.ObjectRef]) -> None:
        """Track ``job`` and send its actor ``call``; any error becomes its failed result."""
        self.jobs.begin(job)
        try:
            keys, chunks = self.job_slots(job)
            if self._closed:
                raise RuntimeError("object_store tier is shut down")
            if not keys:
                self.jobs.succeed(job, transfer_bytes=0)
                return
            timeout = self.options.job_timeout_s
            ref = call(keys, chunks, timeout)
            with self._lock:
                self._inflight[ref] = _InFlight(kind, job, keys, time.monotonic() + timeout)
        except Exception as e:  # a job must end in a result, whatever happens
            self.jobs.fail(job, f"object_store {kind} not submitted: {e!r}")

    def _sources(self, keys: list[bytes]) -> dict[str, list[int]]:
        """Per other node's actor, the positions of keys whose lookup answer
        chose it (the load then asks that actor directly; keys without a
        known answer are left to the actor, which asks the directory)."""
        out: dict[str, list[int]] = {}
        planner = self.services.planner
        for i, k in enumerate(keys):
            holders = self._cache.get(k)
            source = planner.source(self.key_tag, holders) if holders else None
            if source is not None and source.holder_id != self.holder_id and self.can_load(source):
                out.setdefault(source.actor_name, []).append(i)
        return out

    def _check_actor(self) -> None:
        """Notice the node actor's death (and its restart) without blocking."""
        if not self._closed:
            self.liveness.poll()

    def poll_jobs(self) -> None:
        self._check_actor()
        with self._lock:
            if not self._inflight:
                return
            refs = list(self._inflight)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        now = time.monotonic()
        ready_set = set(ready)
        finished: list[tuple[ray.ObjectRef | None, _InFlight]] = []
        with self._lock:
            for ref in refs:
                if ref in ready_set or now > self._inflight[ref].deadline:
                    finished.append((ref if ref in ready_set else None, self._inflight.pop(ref)))
        for ref, entry in finished:
            self._finish(ref, entry)

    def _finish(self, ref: ray.ObjectRef | None, entry: _InFlight) -> None:
        job = entry.job
        if ref is None:
            self.jobs.fail(job, f"object_store {entry.kind} timed out after {self.options.job_timeout_s}s")
            if entry.kind == "load":
                self._cache.invalidate(entry.keys, TIER_TYPE)
            return
        try:
            out = ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            self.jobs.fail(job, f"object_store actor of node {self.node_id} unavailable: {type(e).__name__}")
            if entry.kind == "load":
                self._cache.invalidate(entry.keys, TIER_TYPE)
            return
        except Exception as e:
            self.jobs.fail(job, f"object_store {entry.kind} failed: {e!r}")
            if entry.kind == "load":
                self._cache.invalidate(entry.keys, TIER_TYPE)
            return
        if entry.kind == "store":
            if out.get("error"):
                self.jobs.fail(job, f"object_store store failed: {out['error']}")
            else:
                self._cache.note_stored(entry.keys, self.holder_info)
                self.jobs.succeed(job, transfer_bytes=out.get("bytes", 0))
            return
        errors: dict[int, str] = out.get("errors", {})
        if not errors:
            self.jobs.succeed(job, transfer_bytes=out.get("bytes", 0))
            return
        self._cache.invalidate([entry.keys[i] for i in errors], TIER_TYPE)
        originals = list(job.keys)
        ok = [originals[i] for i in out.get("ok", [])]
        shown = "; ".join(f"{entry.keys[i].hex()[:12]}: {why}" for i, why in list(errors.items())[:3])
        more = f"; +{len(errors) - 3} more" if len(errors) > 3 else ""
        self.jobs.fail(job, f"{len(errors)} of {len(entry.keys)} keys not loaded: {shown}{more}", successful_keys=ok)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Queued; sent to the node's actor once per step (``on_schedule_end``)."""
        if keys and not self._closed:
            with self._lock:
                self._touches.update(dict.fromkeys(self.key_tag + bytes(k) for k in keys))

    def on_schedule_end(self) -> None:
        super().on_schedule_end()
        self._check_actor()
        with self._lock:
            touches, self._touches = self._touches, {}
        if touches and not self._closed:
            try:
                self.actor.touch.remote(list(touches))
            except Exception as e:  # best effort
                logger.debug("object_store touch not sent: %r", e)

    def has_pending_work(self) -> bool:
        with self._lock:
            inflight = bool(self._inflight)
        return inflight or super().has_pending_work()

    # -- tools -----------------------------------------------------------------
    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """The node actor's stats (blocking; tools and tests)."""
        return ray.get(self.actor.stats.remote(), timeout=timeout)

    def shutdown(self) -> None:
        """Fail what is still in flight; the node's actor and its blocks live on."""
        if self._closed:
            return
        self._closed = True
        self.leave_planner()
        self.poll_jobs()
        with self._lock:
            left = list(self._inflight.values())
            self._inflight.clear()
        for entry in left:
            self.jobs.fail(entry.job, "object_store tier shut down")
        self.liveness.close()
