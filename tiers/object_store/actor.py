"""``ObjectStoreActor``: one per node; owns the node's plasma objects of KV blocks.

The actor, not the engine, calls ``ray.put``, so the objects outlive any
engine (``ray.put(_owner=...)`` is gone in Ray 2.60: an object dies with the
process that put it). It maps the engines' primary regions (``/dev/shm``
files, ``RegionMap``) itself, so block bytes never travel as actor-call
arguments:

- ``store``: the job's new blocks -> packed plasma objects (``packing``),
  after evicting least-recently-used packs to stay within capacity; the new
  keys are registered at the directory in one batched call (per shard).
- ``load``: blocks held here come from a zero-copy ``ray.get`` of their pack
  and are copied once into the primary slots; blocks held by another node's
  actor are found there (``get_refs`` returns ObjectRefs, never bytes;
  ``remote.PeerFetcher``) and pulled through Ray's object manager by
  ``ray.get``, then copied. Each key succeeds or fails on its own.
- ``replicate`` (``replicating.ReplicateCalls``): blocks other nodes' actors
  hold are pulled as a load pulls them and stored as this node's own packs,
  as a store stores them (``raykv warm --all-nodes``).

The actor is the Ray shell around plain classes that run without Ray:
``PackStore`` (packs, LRU, capacity, tenant quotas, pins, what a store or load
decides), ``RegionMap``, ``PeerSearch`` (whom to ask) and ``copying``. It keeps
``ray.put`` / ``ray.get``, the calls to the directory and to other nodes'
actors (``remote``), the store lock and the copy threads.

It is the directory's holder ``object_store:<node_id>`` (medium PLASMA): when
it dies the directory drops its keys at once (it watches ``raykv_watch``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import ray
from ray.actor import ActorHandle

from raykv.core import naming
from raykv.core.pins import REFUSED_COUNTERS
from raykv.core.tenants import DEFAULT_TENANT, fmt_tenants
from raykv.core.units import fmt_bytes
from raykv.core.wire import LoadAnswer, Report, StoreAnswer
from raykv.engine.primary import RegionHandle
from raykv.holders.holder_actor import HolderActor, runs_to_end, settle, start_on_node
from tiers.object_store import copying
from tiers.object_store.index_calls import IndexCalls
from tiers.object_store.messages import TIER_TYPE, ObjectStoreSettings, holder_info
from tiers.object_store.pack_store import PackStore, StorePlan, StoreRefused, registering
from tiers.object_store.packing import Pack
from tiers.object_store.regions import RegionMap
from tiers.object_store.remote import PeerFetcher, fetch_packs
from tiers.object_store.replicating import ReplicateCalls
from tiers.object_store.timings import Timings, slow_load

logger = logging.getLogger(__name__)

__all__ = ["METRIC_COUNTERS", "TIER_TYPE", "ObjectStoreActor", "holder_info", "start_actor"]

_T = TypeVar("_T")

#: The actor's counters exported as raykv's tier metrics (tier object_store, per node).
METRIC_COUNTERS = {
    "stored_blocks": "raykv_tier_stored_blocks",
    "evicted_blocks": "raykv_tier_evicted_blocks",
    "hits": "raykv_tier_served_blocks",
    "misses": "raykv_tier_load_misses",
    "served_remote": "raykv_object_store_served_remote_blocks",
}


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=10_000)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
class ObjectStoreActor(IndexCalls, ReplicateCalls, HolderActor):
    """The node's owner of packed KV blocks in plasma, with LRU byte capacity."""

    def __init__(self, node_id: str, namespace: str, settings: ObjectStoreSettings) -> None:
        super().__init__(holder_info(node_id, namespace), namespace, METRIC_COUNTERS)
        self.node_id = node_id
        self.settings = settings
        self.requested_capacity = settings.capacity_bytes
        self.packs = PackStore(settings, ray.put)
        self.counters.update(dict.fromkeys(REFUSED_COUNTERS.values(), 0))
        self.regions = RegionMap(node_id)
        self.plasma_bytes = 0
        self.timings = Timings(("store", "load", "put", "replicate"))
        self.peers = PeerFetcher(self.info.actor_name, node_id, namespace, settings.remote_timeout_s, self.counters)
        self._relays = set()
        self._store_lock = asyncio.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="raykv-os-copy")

    async def recover(self) -> None:
        """Nothing outlives the actor; cap the capacity to what this node's
        plasma can hold without spilling."""
        self.plasma_bytes = await asyncio.to_thread(_node_object_store_bytes, self.node_id)
        capped = self.packs.fit_to_node(self.plasma_bytes)
        if capped is not None:
            logger.warning("object store tier on %s: %s", self.node_id, capped)

    def __repr__(self) -> str:
        # What and where only: the dashboard records a repr once, at start (live
        # figures: `raykv status`, metrics). Must work when __init__ raised early.
        d = self.__dict__
        packs = d.get("packs")
        cap = packs.index.capacity if packs is not None else d.get("requested_capacity")
        capacity = fmt_bytes(cap) if cap is not None else "?"
        return f"ObjectStore(node={str(d.get('node_id', '?'))[:12]}, capacity {capacity})"

    def status_line(self) -> str:
        c, index = self.counters, self.packs.index
        used, cap = index.used, index.capacity
        return (
            f"object_store node={self.node_id[:12]}: {len(index)} blocks in {index.num_packs} packs, "
            f"{fmt_bytes(used)} / {fmt_bytes(cap)} ({100 * used / cap if cap else 0:.0f}%); "
            f"stored {c['stored_blocks']}, evicted {c['evicted_blocks']}, served {c['hits']} "
            f"(to other nodes {c['served_remote']}), load misses {c['misses']}"
            f"{fmt_tenants(index.tenants.bytes_by_tenant())}"
        )

    def held_keys(self) -> list[bytes]:
        return self.packs.index.keys()

    def occupancy(self) -> tuple[int, int, int]:
        index = self.packs.index
        return len(index), index.used, index.capacity

    def started_with(self) -> ObjectStoreSettings:
        return self.settings

    def describe(self) -> Report:
        return {
            "node_id": self.node_id,
            "capacity_bytes": self.packs.index.capacity,
            "requested_capacity_bytes": self.requested_capacity,
        }

    # -- helpers -----------------------------------------------------------
    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` on the copy threads (the event loop keeps answering)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- store -------------------------------------------------------------
    @runs_to_end
    async def store(
        self,
        job_id: int,
        region: RegionHandle,
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
        tenant: str = DEFAULT_TENANT,
        cache_ttl_s: float | None = None,
    ) -> StoreAnswer:
        """Put the blocks of ``keys`` (at ``chunk_ids`` of ``region``) into plasma,
        charged to ``tenant`` (``raykv.core.tenants``: quotas and per-tenant LRU),
        and pinned for ``cache_ttl_s`` seconds when given (``raykv.core.pins``;
        a refused pin is counted and the blocks stay, unpinned).

        Keys already held are skipped (and touched; pinned or their pins
        extended with a TTL). Answers the bytes stored,
        or ``error`` (nothing new is stored then; or already-held keys of the
        job were evicted to make room for its new blocks).
        """
        await self._started
        self.counters["store_calls"] += 1
        try:
            return await self._store(region, keys, chunk_ids, tenant, cache_ttl_s)
        finally:
            # (visible state: no store in flight once it equals store_calls)
            self.counters["stores_answered"] += 1

    async def _store(
        self, region: RegionHandle, keys: Sequence[bytes], chunk_ids: Sequence[int], tenant: str, ttl_s: float | None
    ) -> StoreAnswer:
        t0 = time.perf_counter()
        try:
            async with self._store_lock:
                try:
                    array = self.regions.array(region)
                except (OSError, ValueError) as e:
                    raise StoreRefused(f"cannot map primary region {region.path}: {e}") from e
                plan = self.packs.plan_store(keys, chunk_ids, region.num_chunks, region.bytes_per_chunk, tenant)
                if not plan.new_keys:
                    self.packs.pin(plan.held, ttl_s).count_into(self.counters)
                    return StoreAnswer()
                unregister = await self._evict_for(plan)
                packs, register = await self._put(array, plan, unregister)
                self.packs.pin([*plan.held, *plan.new_keys], ttl_s).count_into(self.counters)
        except StoreRefused as e:
            if e.counter:
                self.counters[e.counter] += 1
            return StoreAnswer(error=e.why)
        self.counters["directory_errors"] += await settle([register, *unregister])
        for pack in packs:
            pack.registering = None
        self.timings.add("store", time.perf_counter() - t0)
        lost = self.packs.lost(plan)
        error = f"{len(lost)} already-held keys of the job were evicted to make room for its new blocks"
        return StoreAnswer(bytes=plan.nbytes, error=error if lost else None)

    async def _evict_for(self, plan: StorePlan) -> list[ray.ObjectRef[int]]:
        """Evict LRU packs for ``plan``'s blocks; the unregister calls of the
        evicted keys (sent). ``StoreRefused`` when there is no room."""
        evicted, dropped = self.packs.make_room(plan)
        await _registered(dropped)
        del dropped  # our refs to the evicted packs go: plasma frees them
        unregister = self._writes.unregister(self.info.holder_id, evicted) if evicted else []
        self.counters["evicted_blocks"] += len(evicted)
        self.log.append(True, evicted)
        if not self.packs.has_room(plan):  # tenant quotas protect what is left
            await self._settled(unregister)
            self._publish()
            raise self.packs.no_room(plan)
        return unregister

    async def _put(
        self, array: np.ndarray, plan: StorePlan, unregister: list[ray.ObjectRef[int]]
    ) -> tuple[list[Pack], asyncio.Future[list[int]]]:
        """Put ``plan``'s blocks into plasma and take them in; the packs and
        their directory registration (sent, awaited by the caller)."""
        try:
            t0 = time.perf_counter()
            packs = await self._run(self.packs.put_packs, array, plan)
            self.timings.add("put", time.perf_counter() - t0)
        except Exception as e:
            await asyncio.gather(*unregister, return_exceptions=True)
            raise StoreRefused(_put_failed(e), "store_errors") from e
        self.packs.add(packs)
        self.log.append(False, plan.new_keys)
        # Awaited outside the lock (stores overlap); a later eviction of
        # these packs waits for it (``registering``).
        register = asyncio.gather(*self._writes.register(self.info.holder_id, plan.new_keys))
        for pack in packs:
            pack.registering = register
        self.counters["stored_blocks"] += len(plan.new_keys)
        self.counters["stored_bytes"] += plan.nbytes
        self._publish()
        return packs, register

    # -- load --------------------------------------------------------------
    async def load(
        self,
        job_id: int,
        region: RegionHandle,
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
        sources: dict[str, list[int]] | None = None,
        deadline: float | None = None,
    ) -> LoadAnswer:
        """Copy the blocks of ``keys`` into ``chunk_ids`` of ``region``.

        ``sources`` hints, per other node's actor name, the positions of keys
        it holds; keys held neither here nor at their hinted source are looked
        up at the directory. Nothing is copied after ``deadline`` (wall clock).
        """
        await self._started
        t0 = time.perf_counter()
        self.counters["load_calls"] += 1
        try:
            array = self.regions.array(region)
        except (OSError, ValueError) as e:
            return LoadAnswer(errors={i: f"cannot map primary region: {e}" for i in range(len(keys))})
        bpc = region.bytes_per_chunk
        self.counters["loads_requested"] += len(keys)
        plan = self.packs.plan_load(keys, chunk_ids, region.num_chunks)
        remote = []
        if plan.remote:
            remote = await self.peers.find(self._directory, keys, plan.remote, sources or {}, plan.errors)
        phases = [("find", time.perf_counter() - t0)]
        done: list[int] = []
        # Local values are zero-copy numpy views into this node's plasma.
        for packs, timeout, what in (
            (plan.local, None, "local pack unreadable"),
            (remote, self.settings.remote_timeout_s, "pull failed"),
        ):
            t1 = time.perf_counter()
            ready = await fetch_packs(packs, timeout, what, plan.errors)
            phases.append(("get local" if packs is plan.local else "pull", time.perf_counter() - t1))
            if ready:
                ok, bad = await copying.copy_in_threads(self._pool, array, bpc, chunk_ids, ready, deadline)
                done += ok
                plan.errors.update(bad)
                if packs is remote:
                    self.counters["hits_remote"] += len(ok)
            del ready  # drop our views of the packs
        self.counters["hits"] += len(done)
        self.counters["misses"] += len(plan.errors)
        self.counters["loaded_bytes"] += len(done) * bpc
        self._publish()
        self.timings.add("load", time.perf_counter() - t0)
        slow_load(job_id, len(keys), len(plan.local), len(remote), time.perf_counter() - t0, phases)
        return LoadAnswer(ok=tuple(sorted(done)), errors=plan.errors, bytes=len(done) * bpc)

    # -- other API ---------------------------------------------------------
    async def drop_identities(self, tags: Sequence[bytes]) -> int:
        """Forget every block whose key starts with one of ``tags`` (``raykv
        invalidate``): out of the index and the directory, packs released."""
        await self._started
        async with self._store_lock:
            removed, dropped = self.packs.remove_prefixed(tags)
            await _registered(dropped)
            self.log.append(True, removed)
            self.counters["invalidated_blocks"] += len(removed)
            del dropped  # our refs to fully dropped packs go: plasma frees them
            await self._unregister(removed)
            self._publish()
        return len(removed)

    def tier_stats(self) -> Report:
        return {
            "node_id": self.node_id,
            **self.packs.report(),
            "requested_capacity_bytes": self.requested_capacity,
            "node_object_store_bytes": self.plasma_bytes,
            "hits": self.counters["hits"],
            "loads_requested": self.counters["loads_requested"],
            "mapped_regions": len(self.regions),
            **self.timings.median_ms(),
            "counters": {name: n for name, n in self.counters.items()},
        }


async def _registered(dropped: list[Pack]) -> None:
    """Let dropped packs' registrations in flight land, so that the unregister
    of their keys cannot overtake them at a directory shard."""
    pending = registering(dropped)
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def _put_failed(e: Exception) -> str:
    if isinstance(e, (ray.exceptions.ObjectStoreFullError, ray.exceptions.OutOfDiskError)):
        # Other objects fill plasma (and the disk it falls back to): a miss, not a crash.
        return f"the node's object store is full; nothing stored ({e!r})"
    return f"ray.put failed: {e!r}"


def _node_object_store_bytes(node_id: str) -> int:
    try:
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return int(node.get("Resources", {}).get("object_store_memory", 0))
    except Exception as e:
        logger.debug("cannot read the node's object store size: %r", e)
    return 0


def start_actor(node_id: str, namespace: str, settings: ObjectStoreSettings) -> ActorHandle:
    """Start (or find) the object store actor of ``node_id``; returns its handle."""
    return start_on_node(
        ObjectStoreActor, naming.object_store_actor(node_id), node_id, namespace, node_id, namespace, settings
    )
