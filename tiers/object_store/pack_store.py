"""``PackStore``: a node actor's packs of blocks and the rules of storing and loading them.

The plain part of ``ObjectStoreActor``: its ``PackIndex`` (keys -> packs, LRU,
capacity, tenant quotas) and what a store or a load decides before and after
its Ray calls. It puts packs with the ``put`` it is given (``ray.put`` in the
actor) and hands out what ``put`` returned as ``PackRef.ref``, never looking
inside, so it runs and is tested without Ray.

A store: ``plan_store`` sorts the job's keys into new and already held,
``make_room`` evicts whole LRU packs for the new bytes (``has_room`` then says
whether tenant quotas left enough), ``put_packs`` puts the new blocks as packs
of at most ``max_pack_bytes`` and ``add`` takes them in. A load:
``plan_load`` finds the packs of the keys held here; ``refs_for`` answers
another node's actor (``get_refs``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from raykv.core.pins import PinOutcome
from raykv.core.wire import Report
from tiers.object_store import packing
from tiers.object_store.messages import ObjectStoreSettings, PackRef
from tiers.object_store.packing import CapacityError, Pack, PackIndex


class StoreRefused(Exception):
    """A store job that stores nothing new: ``why``, and the actor counter it counts in."""

    def __init__(self, why: str, counter: str | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.counter = counter


@dataclass
class StorePlan:
    """A store job's keys sorted out: the blocks to put, the ones already held."""

    tenant: str
    block_bytes: int
    new_keys: list[bytes] = field(default_factory=list)
    new_chunks: list[int] = field(default_factory=list)
    held: list[bytes] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return len(self.new_keys) * self.block_bytes


@dataclass
class LoadPlan:
    """A load job's keys sorted out: packs held here, positions to find elsewhere."""

    local: list[PackRef] = field(default_factory=list)
    #: Positions of keys not held here (another node's actor may hold them).
    remote: list[int] = field(default_factory=list)
    #: Position -> why it cannot load.
    errors: dict[int, str] = field(default_factory=dict)


class PackStore:
    """A node's packs of KV blocks, within a byte capacity and tenant quotas."""

    def __init__(self, settings: ObjectStoreSettings, put: Callable[[object], object]) -> None:
        self.settings = settings
        self.index = PackIndex(settings.capacity_bytes, settings.tenant_quotas, settings.max_pinned_fraction)
        self._put = put
        self._pack_ids = itertools.count()

    def fit_to_node(self, node_bytes: int) -> str | None:
        """Cap the capacity at ``max_object_store_fraction`` of the node's object
        store of ``node_bytes`` (0: unknown); what was capped (for the log), if anything."""
        fraction = self.settings.max_object_store_fraction
        limit = int(fraction * node_bytes)
        if not node_bytes or self.settings.capacity_bytes <= limit:
            return None
        self.index.capacity = limit
        return (
            f"capacity_bytes={self.settings.capacity_bytes} exceeds {fraction:.0%} of the node's object store "
            f"({node_bytes} bytes); using {limit}"
        )

    # -- store -----------------------------------------------------------------
    def plan_store(
        self, keys: Sequence[bytes], chunk_ids: Sequence[int], num_chunks: int, block_bytes: int, tenant: str
    ) -> StorePlan:
        """Sort a store job's keys (the first of a repeated key counts); already
        held ones count as used (LRU). ``StoreRefused`` for a chunk id out of range."""
        plan = StorePlan(tenant, block_bytes)
        seen: set[bytes] = set()
        for k, c in zip(keys, chunk_ids):
            if k in seen:
                continue
            seen.add(k)
            if not 0 <= c < num_chunks:
                raise StoreRefused(f"chunk id {c} out of range [0, {num_chunks})")
            if k in self.index:
                plan.held.append(k)
            else:
                plan.new_keys.append(k)
                plan.new_chunks.append(int(c))
        self.index.touch(plan.held)
        return plan

    def make_room(self, plan: StorePlan) -> tuple[list[bytes], list[Pack]]:
        """Evict LRU packs so ``plan``'s new blocks fit: the evicted keys and the
        dropped packs. ``StoreRefused`` (nothing evicted) when they exceed the
        capacity or the tenant's quota."""
        try:
            return self.index.evict_for(plan.nbytes, plan.tenant)
        except CapacityError as e:
            raise StoreRefused(f"store of {len(plan.new_keys)} blocks {e}", "store_too_big") from e

    def has_room(self, plan: StorePlan) -> bool:
        """Whether ``plan``'s new blocks fit now (after ``make_room``: tenant
        quotas may protect other tenants' blocks, and pinned blocks stay)."""
        return self.index.fits(plan.nbytes, plan.tenant)

    def no_room(self, plan: StorePlan) -> StoreRefused:
        return StoreRefused(
            f"store of {len(plan.new_keys)} blocks for tenant {plan.tenant!r}: no room left without "
            "evicting pinned blocks or other tenants' blocks within their quotas",
            "store_no_room",
        )

    def put_packs(self, array: np.ndarray, plan: StorePlan) -> list[Pack]:
        """Put ``plan``'s new blocks (rows of ``array``) as packs of at most
        ``max_pack_bytes``; not taken in yet (``add``). Raises what ``put`` raises."""
        bpc = plan.block_bytes
        per_pack = max(1, self.settings.max_pack_bytes // bpc)
        flat = array.reshape(-1)
        packs = []
        for i in range(0, len(plan.new_keys), per_pack):
            keys, chunks = plan.new_keys[i : i + per_pack], plan.new_chunks[i : i + per_pack]
            pieces = packing.plan_pieces(chunks, bpc, self.settings.piece_bytes)
            ref = self._put(packing.piece_views(flat, pieces))
            packs.append(Pack(next(self._pack_ids), ref, keys, bpc, packing.piece_ends(pieces), plan.tenant))
        return packs

    def add(self, packs: Iterable[Pack]) -> None:
        for pack in packs:
            self.index.add(pack)

    def pin(self, keys: Iterable[bytes], ttl_s: float | None) -> PinOutcome:
        """Pin held ``keys`` (their packs) for ``ttl_s`` seconds, or extend their
        pins; refused blocks stay held unpinned (``raykv.core.pins``)."""
        return self.index.pin(keys, ttl_s) if ttl_s else PinOutcome()

    def lost(self, plan: StorePlan) -> list[bytes]:
        """Keys the job found held that its own eviction then removed."""
        return [k for k in plan.held if k not in self.index]

    # -- load ------------------------------------------------------------------
    def plan_load(self, keys: Sequence[bytes], chunk_ids: Sequence[int], num_chunks: int) -> LoadPlan:
        """The packs held here for a load's keys (found keys count as used), the
        positions of the others, and chunk ids out of range as errors."""
        plan = LoadPlan()
        local: dict[int, PackRef] = {}
        found: list[bytes] = []
        for i, (k, c) in enumerate(zip(keys, chunk_ids)):
            if not 0 <= c < num_chunks:
                plan.errors[i] = f"chunk id {c} out of range"
                continue
            entry = self.index.get(k)
            if entry is None:
                plan.remote.append(i)
                continue
            _ref_of(local, entry).items.append((i, entry[1]))
            found.append(k)
        self.index.touch(found)
        plan.local = list(local.values())
        return plan

    def refs_for(self, keys: Sequence[bytes]) -> tuple[list[PackRef], int]:
        """For another node's actor: the packs holding ``keys`` (items name
        positions in ``keys``; keys not held are absent) and how many keys were
        found. Found keys count as used."""
        packs: dict[int, PackRef] = {}
        found = []
        for pos, k in enumerate(keys):
            entry = self.index.get(k)
            if entry is not None:
                _ref_of(packs, entry).items.append((pos, entry[1]))
                found.append(k)
        self.index.touch(found)
        return list(packs.values()), len(found)

    # -- other -----------------------------------------------------------------
    def remove_prefixed(self, prefixes: Sequence[bytes]) -> tuple[list[bytes], list[Pack]]:
        """Forget every key starting with one of ``prefixes``: the removed keys
        and the packs dropped (their last key went)."""
        start = tuple(prefixes)
        return self.index.remove([k for k in self.index.keys() if k.startswith(start)])

    def report(self) -> Report:
        """The index's figures for ``stats``."""
        index = self.index
        return {
            "blocks": len(index),
            "packs": index.num_packs,
            "bytes_used": index.used,
            "capacity_bytes": index.capacity,
            "evictions": index.evicted_keys,
            "tenant_bytes": {**index.tenants.bytes_by_tenant()},
            "tenant_quotas": {**index.tenants.quotas},
            "evicted_packs": index.evicted_packs,
            **index.tenants.pin_report(),
        }


def registering(packs: Iterable[Pack]) -> list[asyncio.Future[list[int]]]:
    """The directory registrations of ``packs`` still in flight: an unregister
    of their keys must wait for them, or it could overtake them at a shard."""
    return [p.registering for p in packs if p.registering is not None and not p.registering.done()]


def _ref_of(refs: dict[int, PackRef], entry: tuple[Pack, int]) -> PackRef:
    """The ``PackRef`` of ``entry``'s pack in ``refs`` (added, empty, when new)."""
    pack = entry[0]
    ref = refs.get(pack.pack_id)
    if ref is None:
        ref = refs[pack.pack_id] = PackRef(pack.ref, pack.ends, pack.block_bytes, [])
    return ref
