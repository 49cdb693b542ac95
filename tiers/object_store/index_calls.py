"""``IndexCalls``: the object store actor's small calls over its pack index.

A mixin of ``ObjectStoreActor``, kept out of the actor's own body: ``touch``,
``get_refs`` (another node's actor asks for the packs of keys) and ``holds``;
``pin`` (held keys a request with ``cache_ttl_s`` used: pinned, or their pins
extended; ``raykv.core.pins``; the pins of keys not held here go on to the
other nodes' actors that hold them: a request may have loaded its prefix from
another node, and its TTL must keep that copy too), ``unpin`` (drop pins by tenant, keys or all),
``pinned_keys`` (what ``raykv warm --all-nodes`` copies to every node) and the
counters of pins (granted, refused per reason, unpinned).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

from raykv.core.pins import PinBatch, Unpin
from raykv.core.tenants import TenantLRU
from raykv.directory.client import DirectoryClient
from tiers.object_store.messages import PackRef
from tiers.object_store.pack_store import PackStore
from tiers.object_store.remote import PeerFetcher


class IndexCalls:
    """Touch, holds, pin, unpin and the pin counters, over the actor's ``packs``."""

    packs: PackStore
    counters: Counter[str]
    peers: PeerFetcher
    _directory: DirectoryClient
    _started: asyncio.Task[None]
    #: Pin relays in flight (a reference keeps each task alive until it ends).
    _relays: set[asyncio.Task[int]]

    async def touch(self, keys: Sequence[bytes]) -> int:
        await self._started
        self.counters["touches"] += 1
        return self.packs.index.touch(keys)

    def pin_table(self) -> TenantLRU:
        """The index's tenants and pins (``HolderActor``'s pin gauges)."""
        return self.packs.index.tenants

    async def get_refs(self, keys: Sequence[bytes]) -> list[PackRef]:
        """For another node's actor: the packs holding ``keys`` (ObjectRefs, not
        bytes; items name positions in ``keys``). Keys not held are absent;
        found keys count as used (LRU)."""
        await self._started
        self.counters["get_refs_calls"] += 1
        refs, found = self.packs.refs_for(keys)
        self.counters["served_remote"] += found
        return refs

    async def holds(self, keys: Sequence[bytes]) -> list[bool]:
        await self._started
        return [k in self.packs.index for k in keys]

    async def pin(self, batch: PinBatch) -> int:
        """Touch held keys and pin them (their packs) for their TTLs, or extend
        their pins; how many blocks are pinned."""
        await self._started
        self.counters["pin_calls"] += 1
        pinned = 0
        for ttl, keys in batch.by_ttl().items():
            self.packs.index.touch(keys)
            outcome = self.packs.pin(keys, ttl)
            outcome.count_into(self.counters)
            pinned += outcome.pinned
        elsewhere = [(k, t) for k, t in zip(batch.keys, batch.ttls) if t > 0 and k not in self.packs.index]
        if batch.relay and elsewhere:
            relay = PinBatch(tuple(k for k, _ in elsewhere), tuple(t for _, t in elsewhere), relay=False)
            task = asyncio.get_running_loop().create_task(self.peers.relay_pins(self._directory, relay))
            self._relays.add(task)
            task.add_done_callback(self._relays.discard)
        return pinned

    async def pinned_keys(self, tenant: str, min_seconds_left: float = 0.0) -> list[bytes]:
        """Held keys pinned for ``tenant`` whose pins last at least
        ``min_seconds_left`` more (scoped tier keys, in pin order)."""
        await self._started
        return self.packs.index.tenants.pins.lasting(tenant, max(0.0, min_seconds_left))

    async def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names (the blocks stay, under LRU); how many went."""
        await self._started
        n = self.packs.index.unpin(which)
        self.counters["unpinned_blocks"] += n
        return n
