"""``ReplicateCalls``: copy blocks other nodes' actors hold into this node's plasma.

A mixin of ``ObjectStoreActor``, for ``raykv warm --all-nodes``: ``replicate``
finds the holders of the keys this actor lacks through the directory (as a
load does: ``remote.PeerFetcher``, ``get_refs``), pulls their packs through
Ray's object manager and stores the blocks as this node's own packs, with a
store's accounting: tenant quotas, LRU eviction within the capacity, the keys
registered at the directory, and pins for ``cache_ttl_s`` within their caps
(refusals counted per reason). Keys held here already get their pins extended.

The blocks are gathered out of the pulled packs into one buffer of at most
``max_pack_bytes`` at a time (``gather``) and put as one pack each, so the
actor's heap never holds more than one pack's bytes besides the pulled objects.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np
import ray

from raykv.core.pins import PinOutcome
from raykv.core.tenants import DEFAULT_TENANT
from raykv.directory.client import DirectoryClient
from raykv.holders.holder_actor import runs_to_end, settle
from tiers.object_store.copying import FetchedPack
from tiers.object_store.messages import ObjectStoreSettings, ReplicateAnswer
from tiers.object_store.pack_store import PackStore, StorePlan, StoreRefused
from tiers.object_store.packing import Pack, copy_block
from tiers.object_store.remote import PeerFetcher, fetch_packs
from tiers.object_store.timings import Timings

_T = TypeVar("_T")


class Found(NamedTuple):
    """One pulled block: its key, the pack it came in and its index there."""

    key: bytes
    pack: FetchedPack
    in_pack: int


def found_blocks(keys: Sequence[bytes], fetched: Sequence[FetchedPack]) -> dict[int, list[Found]]:
    """The pulled blocks of ``keys`` (the packs' items name positions in
    ``keys``) per block size, in the order of ``keys``; one per position."""
    at: dict[int, tuple[FetchedPack, int]] = {}
    for pack in fetched:
        for pos, idx in pack.items:
            at.setdefault(pos, (pack, idx))
    out: dict[int, list[Found]] = {}
    for pos in sorted(at):
        pack, idx = at[pos]
        out.setdefault(pack.block_bytes, []).append(Found(keys[pos], pack, idx))
    return out


def gather(blocks: Sequence[Found], block_bytes: int) -> np.ndarray:
    """The blocks' bytes, one row each (copied out of the pulled packs)."""
    out = np.empty((len(blocks), block_bytes), dtype=np.uint8)
    for row, block in zip(out, blocks):
        copy_block(block.pack.pieces, block.pack.ends, block.in_pack, block_bytes, row)
    return out


@dataclass
class Copied:
    """What one ``replicate`` took in so far (the caller settles the directory calls)."""

    keys: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    not_stored: int = 0
    error: str | None = None
    packs: list[Pack] = field(default_factory=list)
    registers: list[asyncio.Future[list[int]]] = field(default_factory=list)
    unregister: list[ray.ObjectRef[int]] = field(default_factory=list)


class ReplicateCalls:
    """``replicate`` over the actor's ``packs``, its peers and its store path."""

    node_id: str
    settings: ObjectStoreSettings
    packs: PackStore
    counters: Counter[str]
    peers: PeerFetcher
    timings: Timings
    _started: asyncio.Task[None]
    _store_lock: asyncio.Lock
    _directory: DirectoryClient

    if TYPE_CHECKING:  # the actor's own (``actor.py``)

        async def _run(self, fn: Callable[..., _T], *args: object) -> _T: ...

        async def _evict_for(self, plan: StorePlan) -> list[ray.ObjectRef[int]]: ...

        async def _put(
            self, array: np.ndarray, plan: StorePlan, unregister: list[ray.ObjectRef[int]]
        ) -> tuple[list[Pack], asyncio.Future[list[int]]]: ...

        def _publish(self) -> None: ...

    @runs_to_end
    async def replicate(
        self, keys: Sequence[bytes], tenant: str = DEFAULT_TENANT, cache_ttl_s: float | None = None
    ) -> ReplicateAnswer:
        """Hold a copy of each of ``keys`` (scoped tier keys) in this node's plasma,
        charged to ``tenant`` and pinned for ``cache_ttl_s`` seconds when given.

        Keys not held here are looked up at the directory and pulled from the
        other nodes' actors that hold them, then stored as this actor's own
        packs (evicting LRU packs for room; nothing of a block size is stored
        when its blocks do not fit). Keys held already are touched and their
        pins extended. Answers what became of each key.
        """
        await self._started
        t0 = time.perf_counter()
        self.counters["replicate_calls"] += 1
        wanted = list(dict.fromkeys(bytes(k) for k in keys))
        missing = [k for k in wanted if k not in self.packs.index]
        fetched: list[FetchedPack] = []
        if missing:
            errors: dict[int, str] = {}
            refs = await self.peers.find(self._directory, missing, list(range(len(missing))), {}, errors)
            fetched = await fetch_packs(refs, self.settings.remote_timeout_s, "pull failed", errors)
        found = found_blocks(missing, fetched)
        del fetched
        async with self._store_lock:
            held = [k for k in wanted if k in self.packs.index]  # stores may have taken some in meanwhile
            self.packs.index.touch(held)
            pins = self.packs.pin(held, cache_ttl_s)  # before any eviction: pinned blocks stay
            copied = Copied()
            held_set = set(held)
            for block_bytes, blocks in found.items():
                new = [b for b in blocks if b.key not in held_set]
                if new:
                    await self._copy_in(new, block_bytes, tenant, copied)
            pins.add(self.packs.pin(copied.keys, cache_ttl_s))
            pins.count_into(self.counters)
        self.counters["directory_errors"] += await settle([*copied.registers, *copied.unregister])
        for pack in copied.packs:
            pack.registering = None
        del found
        self.counters["replicated_blocks"] += len(copied.keys)
        self.counters["replicated_bytes"] += copied.nbytes
        self._publish()
        self.timings.add("replicate", time.perf_counter() - t0)
        return _answer(self.node_id, len(wanted), len(held), copied, pins)

    async def _copy_in(self, blocks: list[Found], block_bytes: int, tenant: str, copied: Copied) -> None:
        """Store ``blocks`` (all of ``block_bytes``) as this actor's packs, as a
        store would; what was stored, or why not, goes into ``copied``."""
        plan = StorePlan(tenant, block_bytes, [b.key for b in blocks], list(range(len(blocks))))
        per_pack = max(1, self.settings.max_pack_bytes // block_bytes)
        done = 0
        try:
            copied.unregister += await self._evict_for(plan)
            for i in range(0, len(blocks), per_pack):
                part = blocks[i : i + per_pack]
                array = await self._run(gather, part, block_bytes)
                sub = StorePlan(tenant, block_bytes, plan.new_keys[i : i + per_pack], list(range(len(part))))
                packs, register = await self._put(array, sub, [])
                del array
                copied.packs += packs
                copied.registers.append(register)
                copied.keys += sub.new_keys
                copied.nbytes += sub.nbytes
                done += len(part)
        except StoreRefused as e:
            if e.counter:
                self.counters[e.counter] += 1
            copied.error = e.why
        copied.not_stored += len(blocks) - done


def _answer(node_id: str, wanted: int, held: int, copied: Copied, pins: PinOutcome) -> ReplicateAnswer:
    copied_n = len(copied.keys)
    return ReplicateAnswer(
        node_id=node_id,
        copied=copied_n,
        copied_bytes=copied.nbytes,
        held=held,
        not_found=wanted - held - copied_n - copied.not_stored,
        not_stored=copied.not_stored,
        pinned=pins.pinned,
        pins_refused=dict(pins.refused),
        error=copied.error,
    )
