"""``ObjectStoreActor``: one per node; owns the node's plasma objects of KV blocks.

The actor, not the engine, calls ``ray.put``, so the objects outlive any
engine (``ray.put(_owner=...)`` is gone in Ray 2.60: an object dies with the
process that put it). It maps the engines' primary regions (``/dev/shm``
files, ``raykv.engine.primary.MappedRegion``) itself, so block bytes never travel as
actor-call arguments:

- ``store``: the job's new blocks -> one packed plasma object (``packing``),
  after evicting least-recently-used packs to stay within capacity; the new
  keys are registered at the directory in one batched call (per shard).
- ``load``: blocks held here come from a zero-copy ``ray.get`` of their pack
  and are copied once into the primary slots; blocks held by another node's
  actor are found there (``get_refs`` returns ObjectRefs, never bytes) and
  pulled through Ray's object manager by ``ray.get``, then copied. Each key
  succeeds or fails on its own.

It is the directory's holder ``object_store:<node_id>`` (medium PLASMA): when
it dies the directory drops its keys at once (it watches ``raykv_watch``).
Heavy copies run on a small thread pool so the event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from raykv.core import naming, placement
from raykv.core.placement import PLASMA, HolderInfo
from raykv.core.tenants import DEFAULT_TENANT, fmt_tenants
from raykv.core.units import fmt_bytes
from raykv.engine.primary import MappedRegion, RegionHandle
from raykv.holders.holder_actor import HolderActor, runs_to_end, start_on_node
from tiers.object_store import packing
from tiers.object_store.packing import CapacityError, Pack, PackIndex

logger = logging.getLogger(__name__)

TIER_TYPE = "object_store"
MAX_MAPPED_REGIONS = 32
#: Threads one load's copy into the primary may use, and the least bytes per thread.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
PARALLEL_COPY_BYTES = 4 << 20


def holder_info(node_id: str, namespace: str) -> HolderInfo:
    """The directory holder of a node's object store actor."""
    return HolderInfo(
        f"{TIER_TYPE}:{node_id}", TIER_TYPE, PLASMA, naming.object_store_actor(node_id), namespace, node_id
    )


def _is_peer(holder: HolderInfo, tried: set[str]) -> bool:
    """An object store actor (of any node) not asked for this key yet."""
    return holder.tier_type == TIER_TYPE and holder.medium == PLASMA and holder.actor_name not in tried


#: The actor's counters exported as raykv's tier metrics (tier object_store, per node).
METRIC_COUNTERS = {
    "stored_blocks": "raykv_tier_stored_blocks",
    "evicted_blocks": "raykv_tier_evicted_blocks",
    "hits": "raykv_tier_served_blocks",
    "misses": "raykv_tier_load_misses",
    "served_remote": "raykv_object_store_served_remote_blocks",
}


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=10_000)
class ObjectStoreActor(HolderActor):
    """The node's owner of packed KV blocks in plasma, with LRU byte capacity."""

    def __init__(self, node_id: str, namespace: str, settings: dict[str, Any]) -> None:
        super().__init__(holder_info(node_id, namespace), namespace, METRIC_COUNTERS)
        self.node_id = node_id
        self.requested_capacity = int(settings["capacity_bytes"])
        self.max_fraction = float(settings.get("max_object_store_fraction", 0.8))
        self.max_pack_bytes = int(settings.get("max_pack_bytes", 64 << 20))
        self.piece_bytes = int(settings.get("piece_bytes", packing.PIECE_BYTES))
        self.remote_timeout_s = float(settings.get("remote_timeout_s", 30.0))
        self.index = PackIndex(self.requested_capacity, settings.get("tenant_quotas"))
        self.plasma_bytes = 0
        self._pack_ids = itertools.count()
        self._regions: OrderedDict[tuple, MappedRegion] = OrderedDict()
        self._last_sweep = 0.0
        self._peers: dict[str, Any] = {}
        self._store_lock = asyncio.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="raykv-os-copy")
        self._durations: dict[str, deque[float]] = {"store": deque(maxlen=64), "load": deque(maxlen=64)}

    async def recover(self) -> None:
        """Nothing outlives the actor; cap the capacity to what this node's
        plasma can hold without spilling."""
        plasma = await asyncio.to_thread(_node_object_store_bytes, self.node_id)
        if plasma and self.requested_capacity > self.max_fraction * plasma:
            self.index.capacity = int(self.max_fraction * plasma)
            logger.warning(
                "object store tier on %s: capacity_bytes=%d exceeds %.0f%% of the node's object store "
                "(%d bytes); using %d",
                self.node_id,
                self.requested_capacity,
                self.max_fraction * 100,
                plasma,
                self.index.capacity,
            )
        self.plasma_bytes = plasma

    def __repr__(self) -> str:
        # What and where only: the dashboard records a repr once, at start (live
        # figures: `raykv status`, metrics). Must work when __init__ raised early.
        d = self.__dict__
        index = d.get("index")
        cap = index.capacity if index is not None else d.get("requested_capacity")
        capacity = fmt_bytes(cap) if cap is not None else "?"
        return f"ObjectStore(node={str(d.get('node_id', '?'))[:12]}, capacity {capacity})"

    def status_line(self) -> str:
        c, used, cap = self.counters, self.index.used, self.index.capacity
        return (
            f"object_store node={self.node_id[:12]}: {len(self.index)} blocks in {self.index.num_packs} packs, "
            f"{fmt_bytes(used)} / {fmt_bytes(cap)} ({100 * used / cap if cap else 0:.0f}%); "
            f"stored {c['stored_blocks']}, evicted {c['evicted_blocks']}, served {c['hits']} "
            f"(to other nodes {c['served_remote']}), load misses {c['misses']}"
            f"{fmt_tenants(self.index.tenants.bytes_by_tenant())}"
        )

    def held_keys(self) -> list[bytes]:
        return self.index.keys()

    def occupancy(self) -> tuple[int, int, int]:
        return len(self.index), self.index.used, self.index.capacity

    def describe(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "capacity_bytes": self.index.capacity,
            "requested_capacity_bytes": self.requested_capacity,
        }

    # -- helpers -----------------------------------------------------------
    def _region(self, handle: RegionHandle) -> np.ndarray:
        """The ``(num_chunks, bytes_per_chunk)`` array of an engine's primary region."""
        if handle.node_id is not None and handle.node_id != self.node_id:
            raise ValueError(f"primary region of node {handle.node_id} cannot be mapped on node {self.node_id}")
        st = os.stat(handle.path)
        ident = (handle.path, handle.offset, handle.num_chunks, handle.bytes_per_chunk, st.st_dev, st.st_ino)
        mapped = self._regions.get(ident)
        if mapped is None:
            self._sweep_regions(force=True)
            mapped = MappedRegion(handle)
            self._regions[ident] = mapped
            while len(self._regions) > MAX_MAPPED_REGIONS:
                _, old = self._regions.popitem(last=False)
                old.close()
        else:
            self._regions.move_to_end(ident)
            self._sweep_regions()
        return mapped.array

    def _sweep_regions(self, force: bool = False) -> None:
        """Unmap regions whose file is gone (an engine closed it), so /dev/shm frees it."""
        now = time.monotonic()
        if not force and now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for ident in list(self._regions):
            path, *_, dev, ino = ident
            try:
                st = os.stat(path)
                gone = (st.st_dev, st.st_ino) != (dev, ino)
            except OSError:
                gone = True
            if gone:
                self._regions.pop(ident).close()

    async def _peer(self, actor_name: str) -> Any:
        handle = self._peers.get(actor_name)
        if handle is None:  # a GCS lookup: off the event loop
            handle = await asyncio.to_thread(ray.get_actor, actor_name, namespace=self.namespace)
            self._peers[actor_name] = handle
        return handle

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _copy_all(
        self, array: np.ndarray, bpc: int, chunk_ids: Sequence[int], packs: list[Any], deadline: float | None
    ) -> tuple[list[int], dict[int, str]]:
        """``_copy`` on up to ``COPY_THREADS`` pool threads at once (numpy copies
        release the GIL; one thread does not reach the memory bandwidth: measured
        here, 2 threads copy 2 MiB blocks 1.4x faster than 1)."""
        total = sum(len(items) for *_, items in packs) * bpc
        k = int(min(COPY_THREADS, max(1, total // PARALLEL_COPY_BYTES)))
        if k <= 1:
            return await self._run(self._copy, array, bpc, chunk_ids, packs, deadline)
        shares = [[(pieces, ends, bb, items[j::k]) for pieces, ends, bb, items in packs] for j in range(k)]
        ok: list[int] = []
        bad: dict[int, str] = {}
        for o, b in await asyncio.gather(
            *(self._run(self._copy, array, bpc, chunk_ids, sh, deadline) for sh in shares)
        ):
            ok += o
            bad.update(b)
        return ok, bad

    # -- API -----------------------------------------------------------------
    @runs_to_end
    async def store(
        self,
        job_id: int,
        region: RegionHandle,
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
        tenant: str = DEFAULT_TENANT,
    ) -> dict[str, Any]:
        """Put the blocks of ``keys`` (at ``chunk_ids`` of ``region``) into plasma,
        charged to ``tenant`` (``raykv.core.tenants``: quotas and per-tenant LRU).

        Keys already held are skipped (and touched). Returns ``stored`` and
        ``held`` counts, or ``error`` (nothing new is stored then).
        """
        await self._started
        t0 = time.perf_counter()
        self.counters["store_calls"] += 1
        async with self._store_lock:
            try:
                array = self._region(region)
            except (OSError, ValueError) as e:
                return {"error": f"cannot map primary region {region.path}: {e}"}
            bpc = region.bytes_per_chunk
            new_keys: list[bytes] = []
            new_chunks: list[int] = []
            held: list[bytes] = []
            seen: set[bytes] = set()
            for k, c in zip(keys, chunk_ids):
                if k in seen:
                    continue
                seen.add(k)
                if not 0 <= c < region.num_chunks:
                    return {"error": f"chunk id {c} out of range [0, {region.num_chunks})"}
                if k in self.index:
                    held.append(k)
                else:
                    new_keys.append(k)
                    new_chunks.append(int(c))
            self.index.touch(held)
            if not new_keys:
                return {"stored": 0, "held": len(held), "bytes": 0, "evicted": 0}
            nbytes = len(new_keys) * bpc
            try:
                evicted, dropped = self.index.evict_for(nbytes, tenant)
            except CapacityError as e:
                self.counters["store_too_big"] += 1
                return {"error": f"store of {len(new_keys)} blocks {e}"}
            # A victim's register may still be in flight: let it land first, so
            # the unregister cannot overtake it at a shard.
            pending = [p.registering for p in dropped if p.registering is not None and not p.registering.done()]
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            del dropped, pending  # our refs to the evicted packs go: plasma frees them
            unregister = self._directory.unregister(self.info.holder_id, evicted) if evicted else []
            self.counters["evicted_blocks"] += len(evicted)
            self.log.append(True, evicted)
            if self.index.used + nbytes > self.index.capacity:  # tenant quotas protect what is left
                await self._settled(unregister)
                self.counters["store_no_room"] += 1
                self._publish()
                return {
                    "error": f"store of {len(new_keys)} blocks for tenant {tenant!r}: no room left without "
                    "evicting other tenants' blocks within their quotas"
                }
            lost = [k for k in held if k not in self.index]
            per_pack = max(1, self.max_pack_bytes // bpc)
            groups = [
                (new_keys[i : i + per_pack], new_chunks[i : i + per_pack]) for i in range(0, len(new_keys), per_pack)
            ]
            try:
                t_put = time.perf_counter()
                packs = await self._run(self._put_packs, array, bpc, groups, tenant)
                self._durations.setdefault("put", deque(maxlen=64)).append(time.perf_counter() - t_put)
            except Exception as e:
                await asyncio.gather(*unregister, return_exceptions=True)
                self.counters["store_errors"] += 1
                if isinstance(e, (ray.exceptions.ObjectStoreFullError, ray.exceptions.OutOfDiskError)):
                    # Other objects fill plasma (and the disk it falls back to): a miss, not a crash.
                    return {"error": f"the node's object store is full; nothing stored ({e!r})"}
                return {"error": f"ray.put failed: {e!r}"}
            for pack in packs:
                self.index.add(pack)
            self.log.append(False, new_keys)
            # Awaited outside the lock (stores overlap); a later eviction of
            # these packs waits for it (``registering``).
            register = asyncio.gather(*self._directory.register(self.info.holder_id, new_keys))
            for pack in packs:
                pack.registering = register
            self.counters["stored_blocks"] += len(new_keys)
            self.counters["stored_bytes"] += nbytes
            self._publish()
        await self._settled([register, *unregister])
        for pack in packs:
            pack.registering = None
        out: dict[str, Any] = {
            "stored": len(new_keys),
            "held": len(held) - len(lost),
            "bytes": nbytes,
            "evicted": len(evicted),
            "seconds": time.perf_counter() - t0,
        }
        self._durations["store"].append(out["seconds"])
        if lost:
            out["error"] = f"{len(lost)} already-held keys of the job were evicted to make room for its new blocks"
        return out

    def _put_packs(
        self, array: np.ndarray, bpc: int, groups: list[tuple[list[bytes], list[int]]], tenant: str = DEFAULT_TENANT
    ) -> list[Pack]:
        flat = array.reshape(-1)
        packs = []
        for keys, chunks in groups:
            plan = packing.plan_pieces(chunks, bpc, self.piece_bytes)
            ref = ray.put(packing.piece_views(flat, plan))
            packs.append(Pack(next(self._pack_ids), ref, keys, bpc, packing.piece_ends(plan), tenant))
        return packs

    async def load(
        self,
        job_id: int,
        region: RegionHandle,
        keys: Sequence[bytes],
        chunk_ids: Sequence[int],
        sources: dict[str, list[int]] | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Copy the blocks of ``keys`` into ``chunk_ids`` of ``region``.

        ``sources`` hints, per other node's actor name, the positions of keys
        it holds; keys held neither here nor at their hinted source are looked
        up at the directory. Nothing is copied after ``deadline`` (wall clock).
        Returns ``ok`` (positions loaded), ``errors`` ({position: reason}) and
        ``bytes``.
        """
        await self._started
        t0 = time.perf_counter()
        self.counters["load_calls"] += 1
        n = len(keys)
        errors: dict[int, str] = {}
        try:
            array = self._region(region)
        except (OSError, ValueError) as e:
            return {"ok": [], "errors": {i: f"cannot map primary region: {e}" for i in range(n)}, "bytes": 0}
        bpc = region.bytes_per_chunk
        self.counters["loads_requested"] += n
        # pack_id -> (pack, [(position in keys, index in pack)])
        local: dict[int, tuple[Pack, list[tuple[int, int]]]] = {}
        remote_wanted: list[int] = []
        for i, (k, c) in enumerate(zip(keys, chunk_ids)):
            if not 0 <= c < region.num_chunks:
                errors[i] = f"chunk id {c} out of range"
                continue
            entry = self.index.get(k)
            if entry is None:
                remote_wanted.append(i)
                continue
            pack, idx = entry
            local.setdefault(pack.pack_id, (pack, []))[1].append((i, idx))
        self.index.touch(keys[i] for _, items in local.values() for i, _ in items)
        local_packs = [(p.ref, p.ends, p.block_bytes, items) for p, items in local.values()]

        remote_packs: list[tuple[Any, list[int], int, list[tuple[int, int]]]] = []
        if remote_wanted:
            remote_packs = await self._find_remote(keys, remote_wanted, sources or {}, errors)

        done: list[int] = []
        # Local values are zero-copy numpy views into this node's plasma.
        for packs, timeout, what in (
            (local_packs, None, "local pack unreadable"),
            (remote_packs, self.remote_timeout_s, "pull failed"),
        ):
            ready = await self._fetch_packs(packs, timeout, what, errors)
            if ready:
                ok, bad = await self._copy_all(array, bpc, chunk_ids, ready, deadline)
                done += ok
                errors.update(bad)
                if packs is remote_packs:
                    self.counters["hits_remote"] += len(ok)
            del ready  # drop our views of the packs
        nbytes = len(done) * bpc
        self.counters["hits"] += len(done)
        self.counters["misses"] += len(errors)
        self.counters["loaded_bytes"] += nbytes
        self._publish()
        seconds = time.perf_counter() - t0
        self._durations["load"].append(seconds)
        return {"ok": sorted(done), "errors": errors, "bytes": nbytes, "seconds": seconds}

    @staticmethod
    async def _fetch_packs(
        packs: list[tuple[Any, list[int], int, list[tuple[int, int]]]],
        timeout: float | None,
        what: str,
        errors: dict[int, str],
    ) -> list[tuple[Any, list[int], int, list[tuple[int, int]]]]:
        """The packs' values (for ``_copy_all``); the keys of a pack that
        cannot be read get ``what`` in ``errors``."""
        if not packs:
            return []
        values = await asyncio.gather(
            *(asyncio.wait_for(ref, timeout) if timeout else ref for ref, *_ in packs), return_exceptions=True
        )
        ready = []
        for (_, ends, bb, items), v in zip(packs, values):
            if isinstance(v, BaseException):
                for i, _ in items:
                    errors[i] = f"{what}: {type(v).__name__}"
            else:
                ready.append((v, ends, bb, items))
        return ready

    async def _find_remote(
        self, keys: Sequence[bytes], wanted: list[int], sources: dict[str, list[int]], errors: dict[int, str]
    ) -> list[tuple[Any, list[int], int, list[tuple[int, int]]]]:
        """Refs of the packs that other nodes' actors hold for ``keys[wanted]``.

        Round 1 asks the hinted sources, and the holders the directory names
        for unhinted keys; round 2 asks the directory again for keys a hinted
        source no longer had (evicted there), excluding actors already asked.
        """
        found: list[tuple[Any, list[int], int, list[tuple[int, int]]]] = []
        wanted_set = set(wanted)
        tried: dict[int, set[str]] = {i: {self.info.actor_name} for i in wanted}
        todo: dict[str, list[int]] = {}
        hinted: set[int] = set()
        for name, positions in sources.items():
            if name == self.info.actor_name:
                continue
            for p in positions:
                if p in wanted_set and p not in hinted:
                    todo.setdefault(name, []).append(p)
                    hinted.add(p)
        unhinted = [i for i in wanted if i not in hinted]
        if unhinted:
            for name, ps in (await self._locate(keys, unhinted, tried)).items():
                todo.setdefault(name, []).extend(ps)
        got = await self._ask_peers(keys, todo, tried, found)
        retry = [i for i in wanted if i not in got and i in hinted]
        if retry:
            got |= await self._ask_peers(keys, await self._locate(keys, retry, tried), tried, found)
        for i in wanted:
            if i not in got:
                errors.setdefault(i, "not held by any object store actor")
        return found

    async def _locate(
        self, keys: Sequence[bytes], positions: list[int], tried: dict[int, set[str]]
    ) -> dict[str, list[int]]:
        """Directory lookup (the engine's answer was missing or stale): per
        other node's actor name, the positions it holds and we did not ask yet."""
        self.counters["directory_lookups"] += 1
        try:
            answers = await self._directory.lookup_async([keys[i] for i in positions]).result_async(
                self.remote_timeout_s
            )
        except Exception as e:
            logger.warning("directory lookup for a load failed: %r", e)
            return {}
        todo: dict[str, list[int]] = {}
        for pos, holders in zip(positions, answers):
            peer = placement.choose(holders, self.node_id, lambda h: _is_peer(h, tried[pos]))
            if peer is not None:
                todo.setdefault(peer.actor_name, []).append(pos)
        return todo

    async def _ask_peers(
        self,
        keys: Sequence[bytes],
        todo: dict[str, list[int]],
        tried: dict[int, set[str]],
        found: list[tuple[Any, list[int], int, list[tuple[int, int]]]],
    ) -> set[int]:
        """Ask each peer (one call each) for its packs of ``todo``'s keys;
        appends them to ``found`` and returns the positions found."""
        got: set[int] = set()
        if not todo:
            return got
        names = list(todo)

        async def ask(name: str) -> Any:
            for p in todo[name]:
                tried[p].add(name)
            ref = (await self._peer(name)).get_refs.remote([keys[p] for p in todo[name]])
            return await asyncio.wait_for(ref, self.remote_timeout_s)

        answers = await asyncio.gather(*(ask(n) for n in names), return_exceptions=True)
        for name, answer in zip(names, answers):
            if isinstance(answer, BaseException):
                self._peers.pop(name, None)
                logger.info("object store peer %s unavailable: %r", name, answer)
                continue
            positions = todo[name]
            for entry in answer:
                items = [(positions[q], idx) for q, idx in entry["items"]]
                got.update(p for p, _ in items)
                found.append((entry["ref"], entry["ends"], entry["block_bytes"], items))
        return got

    async def get_refs(self, keys: Sequence[bytes]) -> list[dict[str, Any]]:
        """For another node's actor: the packs holding ``keys`` (ObjectRefs, not bytes).

        Each entry: ``ref``, ``ends``, ``block_bytes`` and ``items``
        ([(position in ``keys``, index in pack)]). Keys not held are absent.
        Found keys count as used (LRU).
        """
        await self._started
        self.counters["get_refs_calls"] += 1
        packs: dict[int, dict[str, Any]] = {}
        found = []
        for pos, k in enumerate(keys):
            entry = self.index.get(k)
            if entry is None:
                continue
            pack, idx = entry
            found.append(k)
            e = packs.get(pack.pack_id)
            if e is None:
                e = packs[pack.pack_id] = {
                    "ref": pack.ref,
                    "ends": pack.ends,
                    "block_bytes": pack.block_bytes,
                    "items": [],
                }
            e["items"].append((pos, idx))
        self.index.touch(found)
        self.counters["served_remote"] += len(found)
        return list(packs.values())

    @staticmethod
    def _copy(
        array: np.ndarray, bpc: int, chunk_ids: Sequence[int], packs: list[Any], deadline: float | None
    ) -> tuple[list[int], dict[int, str]]:
        ok: list[int] = []
        bad: dict[int, str] = {}
        late = deadline is not None and time.time() > deadline
        for pieces, ends, block_bytes, items in packs:
            for i, idx in items:
                if late:
                    bad[i] = "load deadline passed before the copy"
                elif block_bytes != bpc:
                    bad[i] = f"stored block has {block_bytes} bytes, primary chunks have {bpc}"
                else:
                    packing.copy_block(pieces, ends, idx, bpc, array[chunk_ids[i]])
                    ok.append(i)
        return ok, bad

    async def touch(self, keys: Sequence[bytes]) -> int:
        await self._started
        self.counters["touches"] += 1
        return self.index.touch(keys)

    async def drop_identities(self, tags: Sequence[bytes]) -> int:
        """Forget every block whose key starts with one of ``tags`` (``raykv
        invalidate``): out of the index and the directory, packs released."""
        await self._started
        prefixes = tuple(tags)
        async with self._store_lock:
            removed, dropped = self.index.remove([k for k in self.index.keys() if k.startswith(prefixes)])
            pending = [p.registering for p in dropped if p.registering is not None and not p.registering.done()]
            if pending:  # let in-flight registrations land before unregistering
                await asyncio.gather(*pending, return_exceptions=True)
            self.log.append(True, removed)
            self.counters["invalidated_blocks"] += len(removed)
            del dropped, pending  # our refs to fully dropped packs go: plasma frees them
            await self._unregister(removed)
            self._publish()
        return len(removed)

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        await self._started
        return [k in self.index for k in keys]

    def tier_stats(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "blocks": len(self.index),
            "packs": self.index.num_packs,
            "bytes_used": self.index.used,
            "capacity_bytes": self.index.capacity,
            "requested_capacity_bytes": self.requested_capacity,
            "node_object_store_bytes": self.plasma_bytes,
            "evictions": self.index.evicted_keys,
            "tenant_bytes": self.index.tenants.bytes_by_tenant(),
            "tenant_quotas": dict(self.index.tenants.quotas),
            "evicted_packs": self.index.evicted_packs,
            "hits": self.counters["hits"],
            "loads_requested": self.counters["loads_requested"],
            "mapped_regions": len(self._regions),
            "store_ms_p50": _p50_ms(self._durations["store"]),
            "load_ms_p50": _p50_ms(self._durations["load"]),
            "put_ms_p50": _p50_ms(self._durations.get("put", deque())),
            "counters": dict(self.counters),
        }


def _p50_ms(xs: deque[float]) -> float:
    return float(np.median(xs) * 1000) if xs else 0.0


def _node_object_store_bytes(node_id: str) -> int:
    try:
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return int(node.get("Resources", {}).get("object_store_memory", 0))
    except Exception as e:
        logger.debug("cannot read the node's object store size: %r", e)
    return 0


def start_actor(node_id: str, namespace: str, settings: dict[str, Any]) -> Any:
    """Start (or find) the object store actor of ``node_id``; returns its handle."""
    return start_on_node(
        ObjectStoreActor, naming.object_store_actor(node_id), node_id, namespace, node_id, namespace, settings
    )
