"""``ObjectStoreTier``: the engine-side client of the node's object store actor.

Runs in the engine's scheduler process and never blocks it: a store or load
job is one actor call (``.remote()``) to this node's ``ObjectStoreActor``,
carrying keys, chunk ids and the primary region's ``RegionHandle`` (never
block bytes: the actor maps the region itself). ``poll_jobs`` turns finished
calls into exactly one ``JobResult`` each (``raykv.core.outcomes``: no ``ray.wait``); a
dead actor, an exception or a job past ``job_timeout_s`` becomes a failed
result, and a load where some keys were missing or evicted reports the keys
that did load.

Which keys it serves: those whose chosen holder (``raykv.core.placement``: this
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
from collections.abc import Collection
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from raykv.core.contract import ReqContext, TransferJob, check_primary_holds_a_block
from raykv.core.fields import bytes_option, namespace_option, opt
from raykv.core.identity import KVIdentity
from raykv.core.keys import OffloadKey
from raykv.core.pins import PinBatch, Unpin, cache_ttl_of, max_pinned_fraction_option
from raykv.core.tenants import tenant_of, tenant_quotas_option
from raykv.core.wire import PLASMA, HolderInfo
from raykv.engine.actor_tier import ActorCallTier
from raykv.engine.polling import ActorLiveness
from raykv.engine.primary import RegionHandle, describe_region
from raykv.holders.messages import HolderStats
from raykv.services.cluster import RaykvServices
from tiers.object_store.actor import start_actor
from tiers.object_store.messages import DEFAULT_SETTINGS, TIER_TYPE, ObjectStoreSettings, holder_info

logger = logging.getLogger(__name__)


def _check_fraction(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else f"must be in (0, 1], got {value!r}"


@dataclass
class ObjectStoreOptions:
    namespace: str = namespace_option()
    capacity_bytes: int = bytes_option(
        DEFAULT_SETTINGS.capacity_bytes,
        min=0,
        doc="bytes of blocks each node's actor keeps in plasma (LRU by pack); 0 stores nothing. "
        "Set when a node's actor starts; capped at max_object_store_fraction of the node's object store",
    )
    max_object_store_fraction: float = opt(
        DEFAULT_SETTINGS.max_object_store_fraction,
        kind=float,
        check=_check_fraction,
        doc="largest share of a node's object store the tier may use",
    )
    max_pack_bytes: int = bytes_option(
        DEFAULT_SETTINGS.max_pack_bytes,
        min=1,
        doc="largest plasma object: a store job's blocks are packed into objects of at most this many bytes "
        "(bigger objects pull faster across nodes; smaller ones evict at a finer grain)",
    )
    piece_bytes: int = bytes_option(
        DEFAULT_SETTINGS.piece_bytes,
        min=4096,
        doc="largest buffer handed to ray.put inside a pack (Ray copies buffers over 1 MiB with per-call threads)",
    )
    job_timeout_s: float = opt(
        60.0, kind=float, min=0.1, max=86400.0, doc="a job whose actor call has not answered by then fails"
    )
    tenant_quotas: dict[str, int] = tenant_quotas_option(
        "bytes of blocks on each node", "Set when a node's actor starts"
    )
    max_pinned_fraction: float = max_pinned_fraction_option()

    def actor_settings(self) -> ObjectStoreSettings:
        """What a node's actor started for these options runs with."""
        return ObjectStoreSettings(
            capacity_bytes=self.capacity_bytes,
            max_object_store_fraction=self.max_object_store_fraction,
            max_pack_bytes=self.max_pack_bytes,
            piece_bytes=self.piece_bytes,
            remote_timeout_s=max(0.1, self.job_timeout_s / 2),
            tenant_quotas=dict(self.tenant_quotas),
            max_pinned_fraction=self.max_pinned_fraction,
        )


class ObjectStoreTier(ActorCallTier):
    """KV blocks in the Ray object store, owned by one actor per node."""

    Options = ObjectStoreOptions
    medium = PLASMA
    actor: ActorHandle
    liveness: ActorLiveness

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        options: ObjectStoreOptions,
        services: RaykvServices | None = None,
        identity: KVIdentity | None = None,
        **_: object,
    ) -> None:
        check_primary_holds_a_block(primary_kv_view)  # an empty primary has no region to describe
        try:
            region = describe_region(primary_kv_view)
        except ValueError as e:
            raise ValueError(f"object_store tier: {e}") from e
        super().__init__(primary_kv_view, tier_type, options.namespace, services, identity)
        self.options = options
        self.region: RegionHandle = dataclasses.replace(region, node_id=self.node_id)
        self.holder_info: HolderInfo = holder_info(self.node_id, self.services.namespace)
        self.holder_id = self.holder_info.holder_id
        self.job_timeout_s = options.job_timeout_s
        self.actor = self.ensure_actor(self.services, options, self.node_id)
        self._lock = threading.Lock()
        self._touches: dict[bytes, None] = {}
        self._pins: dict[bytes, float] = {}  # key -> longest TTL asked this step
        self.liveness = ActorLiveness(
            self.actor,
            f"object store actor of node {self.node_id}",
            name=self.holder_info.actor_name,
            namespace=self.services.namespace,
        )

    # -- services ------------------------------------------------------------
    @classmethod
    def ensure_actor(
        cls, services: RaykvServices, options: ObjectStoreOptions, node_id: str, timeout: float = 120.0
    ) -> ActorHandle:
        """Start (or find) ``node_id``'s object store actor and wait until it is ready."""
        settings = options.actor_settings()
        actor = start_actor(node_id, services.namespace, settings)
        what = f"object_store tier: the actor of node {node_id}"
        cls.start_holder_actor(actor, what, options.capacity_bytes, timeout, settings)
        return actor

    @classmethod
    def start_services(cls, services: RaykvServices, options: ObjectStoreOptions) -> list[ActorHandle]:
        """Start one object store actor per alive node; returns their handles."""
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        settings = options.actor_settings()
        actors = [start_actor(node, services.namespace, settings) for node in nodes]
        deadline = time.monotonic() + 120.0  # they start at once: one bound for all, not 120 s per node
        for node, actor in zip(nodes, actors):  # one found running keeps its settings
            left = max(0.1, deadline - time.monotonic())
            cls.start_holder_actor(actor, f"object_store tier on node {node}", options.capacity_bytes, left, settings)
        return actors

    # -- contract ------------------------------------------------------------
    def can_load(self, holder: HolderInfo) -> bool:
        """Every node's object store actor, through this node's (alive) actor."""
        return holder.tier_type == TIER_TYPE and holder.medium == PLASMA and self.liveness.alive

    def submit_store(self, job: TransferJob) -> None:
        tenant, ttl = tenant_of(job.req_context), cache_ttl_of(job.req_context)
        self.send_job(
            "store",
            job,
            lambda keys, chunks: self.actor.store.remote(job.job_id, self.region, keys, chunks, tenant, ttl),
        )

    def submit_load(self, job: TransferJob) -> None:
        self.send_job(
            "load",
            job,
            lambda keys, chunks: self.actor.load.remote(
                job.job_id, self.region, keys, chunks, self._sources(keys), self.load_deadline()
            ),
        )

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

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Queued; sent to the node's actor once per step (``on_schedule_end``).
        A request with ``cache_ttl_s`` pins the keys (or extends their pins)."""
        if keys and not self._closed:
            ttl = cache_ttl_of(req_context)
            with self._lock:
                scope = self.key_scope(req_context)
                scoped = [self.scope(bytes(k), scope=scope) for k in keys]
                if ttl is None:
                    self._touches.update(dict.fromkeys(scoped))
                else:
                    for k in scoped:
                        self._pins[k] = max(ttl, self._pins.get(k, 0.0))

    def on_schedule_end(self) -> None:
        super().on_schedule_end()
        if not self._closed:
            self.liveness.poll()
        with self._lock:
            touches, self._touches = self._touches, {}
            pins, self._pins = self._pins, {}
        if touches and not self._closed:
            try:
                self.actor.touch.remote(list(touches))
            except Exception as e:  # best effort
                logger.debug("object_store touch not sent: %r", e)
        if pins and not self._closed:
            try:
                self.actor.pin.remote(PinBatch(tuple(pins), tuple(pins.values())))
            except Exception as e:  # best effort
                logger.debug("object_store pin not sent: %r", e)

    # -- tools -----------------------------------------------------------------
    def stats(self, timeout: float = 30.0) -> HolderStats:
        """The node actor's stats (blocking; tools and tests): the tier's own in ``figures``."""
        ref: ray.ObjectRef[HolderStats] = self.actor.stats.remote()
        return ray.get(ref, timeout=timeout)

    def unpin(self, which: Unpin, timeout: float = 30.0) -> int:
        """Drop the pins ``which`` names on this node's actor (blocking; tools):
        its blocks then age under LRU. How many blocks were unpinned."""
        ref: ray.ObjectRef[int] = self.actor.unpin.remote(which)
        return ray.get(ref, timeout=timeout)

    def shutdown(self) -> None:
        """Fail what is still in flight; the node's actor and its blocks live on."""
        self.close_calls()
