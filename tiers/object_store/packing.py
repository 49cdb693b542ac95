"""How blocks are packed into plasma objects, and the actor's pack index.

A *pack* is one plasma object holding the blocks of one store job (or of a
slice of it, at most ``max_pack_bytes``). It is ``ray.put`` as a list of
numpy views ("pieces") straight over the primary region, so Ray's serializer
copies each piece into plasma once; there is no gather step. Consecutive
chunk ids are coalesced into one byte run, and runs are cut into pieces of at
most ``PIECE_BYTES``: Ray copies a buffer larger than 1 MiB with a parallel
memcpy that spawns threads on every call, which on small hosts halves the
throughput of 2 MiB blocks (measured: 4.1 GB/s for 32 x 2 MiB views, 9.1 GB/s
for the same bytes as 64 x 1 MiB pieces; see README.md).

The blocks of a pack form one logical byte stream (block ``j`` of the pack at
``j * block_bytes``); ``ends`` are the pieces' cumulative end offsets in that
stream, so a block is found again with a bisection and copied out of the
(zero-copy) pieces that ``ray.get`` returns.

``PackIndex`` is the plain-Python bookkeeping of the node actor: key ->
(pack, position) in LRU order, live keys per pack, and bytes held. Eviction
takes the pack of the least recently used key and evicts every key of that
pack, so each victim frees its bytes at once (evicting single keys of packed
blocks would unregister keys without freeing memory until the last key of the
pack goes). The bytes of live packs never exceed the capacity.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from raykv.core.pins import DEFAULT_MAX_PINNED_FRACTION, PinOutcome, Unpin
from raykv.core.tenants import DEFAULT_TENANT, TenantLRU

#: Largest buffer Ray copies into plasma with a plain (single-thread) memcpy.
PIECE_BYTES = 1 << 20


def plan_pieces(
    chunk_ids: Sequence[int], bytes_per_chunk: int, piece_bytes: int = PIECE_BYTES
) -> list[tuple[int, int]]:
    """Byte ranges ``(start, stop)`` of the flat region holding ``chunk_ids`` in
    order: consecutive chunks coalesced, runs cut at ``piece_bytes``."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
    out: list[tuple[int, int]] = []
    n = len(chunk_ids)
    i = 0
    while i < n:
        j = i + 1
        while j < n and chunk_ids[j] == chunk_ids[j - 1] + 1:
            j += 1
        lo = int(chunk_ids[i]) * bytes_per_chunk
        hi = (int(chunk_ids[j - 1]) + 1) * bytes_per_chunk
        for s in range(lo, hi, piece_bytes):
            out.append((s, min(s + piece_bytes, hi)))
        i = j
    return out


def piece_views(flat: np.ndarray, plan: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Views (no copy) of ``flat`` for each planned piece."""
    return [flat[a:b] for a, b in plan]


def piece_ends(plan: Sequence[tuple[int, int]]) -> list[int]:
    """Cumulative end offset of each piece in the pack's byte stream."""
    ends, total = [], 0
    for a, b in plan:
        total += b - a
        ends.append(total)
    return ends


def copy_block(
    pieces: Sequence[np.ndarray], ends: Sequence[int], index: int, block_bytes: int, dst: np.ndarray
) -> None:
    """Copy block ``index`` of a pack (its ``pieces`` and ``ends``) into ``dst``
    (a 1-D uint8 array of ``block_bytes``)."""
    start = index * block_bytes
    stop = start + block_bytes
    if stop > (ends[-1] if ends else 0):
        raise ValueError(f"block {index} lies beyond the pack's {ends[-1] if ends else 0} bytes")
    k = bisect.bisect_right(ends, start)
    pos = start
    while pos < stop:
        piece_start = ends[k - 1] if k else 0
        a = pos - piece_start
        b = min(stop, ends[k]) - piece_start
        dst[pos - start : pos - start + (b - a)] = pieces[k][a:b]
        pos += b - a
        k += 1


@dataclass(eq=False)
class Pack:
    """One plasma object: the blocks of ``keys`` (in stream order)."""

    pack_id: int
    ref: object  # the ObjectRef (the node actor owns it); any handle in unit tests
    keys: list[bytes]
    block_bytes: int
    ends: list[int]
    tenant: str = ""  # whom the blocks are charged to (tenant quotas)
    live: int = field(init=False)
    #: the directory registration of ``keys`` while in flight (the actor's
    #: asyncio future): an eviction waits for it before unregistering.
    registering: asyncio.Future[list[int]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.live = len(self.keys)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_bytes


class CapacityError(ValueError):
    """A store needs more bytes than the tier's whole capacity."""


class PackIndex:
    """Keys -> (pack, position), LRU order, live keys per pack, bytes held."""

    def __init__(
        self,
        capacity_bytes: int,
        tenant_quotas: Mapping[str, int] | None = None,
        max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = int(capacity_bytes)
        self.used = 0  # bytes of live packs (what plasma holds for us)
        #: Bytes per tenant; victims under quotas and pins (``raykv.core.pins``).
        self.tenants = TenantLRU(tenant_quotas, max_pinned_fraction, clock)
        self._keys: OrderedDict[bytes, tuple[Pack, int]] = OrderedDict()
        self._packs: dict[int, Pack] = {}
        self.evicted_keys = 0
        self.evicted_packs = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    @property
    def num_packs(self) -> int:
        return len(self._packs)

    def get(self, key: bytes) -> tuple[Pack, int] | None:
        return self._keys.get(key)

    def touch(self, keys: Iterable[bytes]) -> int:
        n = 0
        touched = []
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
                touched.append(k)
                n += 1
        self.tenants.touch(touched)
        return n

    def evict_for(self, nbytes: int, tenant: str = DEFAULT_TENANT) -> tuple[list[bytes], list[Pack]]:
        """Evict LRU packs until ``nbytes`` more fit; the evicted keys and the
        dropped packs (release their refs). Raises ``CapacityError`` when
        ``nbytes`` exceeds the capacity (or ``tenant``'s quota) itself; nothing
        is evicted then.

        With tenant quotas the victims follow ``raykv.core.tenants``: ``tenant``'s
        own packs while it is over its quota, then packs of tenants with no
        quota or over it, then its own. Pinned packs are never victims. The
        result may leave no room (only other tenants' blocks within their
        quotas, or pinned ones, are left): check ``fits``.
        """
        if nbytes > self.capacity:
            raise CapacityError(f"needs {nbytes} bytes but the capacity is {self.capacity} bytes")
        quota = self.tenants.quota(tenant)
        if quota is not None and nbytes > quota:
            raise CapacityError(f"needs {nbytes} bytes but tenant {tenant!r} has a quota of {quota} bytes")
        keys: list[bytes] = []
        packs: list[Pack] = []
        if not self.tenants.quotas and not self.tenants.pins:
            while self.used + nbytes > self.capacity and self._keys:
                self._evict_pack(next(iter(self._keys.values()))[0], keys, packs)
        else:
            while (victim := self.tenants.own_victim(tenant, nbytes)) is not None:
                self._evict_pack(self._keys[victim][0], keys, packs)
            while self.used + nbytes > self.capacity and (victim := self.tenants.shared_victim(tenant)) is not None:
                self._evict_pack(self._keys[victim][0], keys, packs)
        self.evicted_keys += len(keys)
        self.evicted_packs += len(packs)
        return keys, packs

    def fits(self, nbytes: int, tenant: str = DEFAULT_TENANT) -> bool:
        """Whether ``nbytes`` more fit the capacity and ``tenant``'s quota now."""
        return self.used + nbytes <= self.capacity and self.tenants.fits(tenant, nbytes)

    def pin(self, keys: Iterable[bytes], ttl_s: float) -> PinOutcome:
        """Pin the packs of held ``keys`` for ``ttl_s`` seconds (or extend their
        pins): a pack is pinned whole or refused whole (``TenantLRU.pin``), as
        an eviction takes it whole."""
        groups: dict[int, list[bytes]] = {}
        for k in keys:
            entry = self._keys.get(k)
            if entry is not None and entry[0].pack_id not in groups:
                pack = entry[0]
                groups[pack.pack_id] = [p for p in pack.keys if (e := self._keys.get(p)) is not None and e[0] is pack]
        return self.tenants.pin(groups.values(), ttl_s, self.capacity)

    def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names; their packs age under LRU again."""
        return self.tenants.unpin(which)

    def _evict_pack(self, pack: Pack, keys: list[bytes], packs: list[Pack]) -> None:
        for k in pack.keys:
            entry = self._keys.get(k)
            if entry is not None and entry[0] is pack:
                del self._keys[k]
                self.tenants.discard(k)
                keys.append(k)
        pack.live = 0
        self._drop(pack)
        packs.append(pack)

    def remove(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[Pack]]:
        """Forget single keys; a pack is dropped (and its bytes freed) when its
        last key goes. Returns the removed keys and the dropped packs."""
        removed: list[bytes] = []
        dropped: list[Pack] = []
        for k in keys:
            entry = self._keys.pop(k, None)
            if entry is None:
                continue
            self.tenants.discard(k)
            removed.append(k)
            pack = entry[0]
            pack.live -= 1
            if pack.live == 0:
                self._drop(pack)
                dropped.append(pack)
        return removed, dropped

    def _drop(self, pack: Pack) -> None:
        if self._packs.pop(pack.pack_id, None) is not None:
            self.used -= pack.nbytes

    def add(self, pack: Pack) -> None:
        """Take a new pack (its keys must not be held already)."""
        for k in pack.keys:
            if k in self._keys:
                raise ValueError(f"key {k.hex()[:16]} is already held")
        self._packs[pack.pack_id] = pack
        self.used += pack.nbytes
        for i, k in enumerate(pack.keys):
            self._keys[k] = (pack, i)
            self.tenants.add(k, pack.tenant, pack.block_bytes)

    def keys(self) -> list[bytes]:
        return list(self._keys)
