"""The Ray calls of a node actor's load: fetching packs, asking other nodes' actors.

``fetch_packs`` awaits packs' ObjectRefs (a zero-copy ``ray.get`` for this
node's plasma; a pull through Ray's object manager for another node's).
``PeerFetcher`` finds the packs of a load's missing keys at other nodes'
actors: ``PeerSearch`` decides whom to ask, ``PeerFetcher`` asks the
directory and the peers (``get_refs``) and keeps their actor handles. It
also relays pins to the peers holding the keys (``relay_pins``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

import ray
from ray.actor import ActorHandle

from raykv.core.pins import PinBatch
from raykv.core.wire import HolderInfo
from raykv.directory.client import DirectoryClient
from tiers.object_store import copying
from tiers.object_store.copying import FetchedPack
from tiers.object_store.messages import PackRef
from tiers.object_store.peers import PeerSearch, is_peer

logger = logging.getLogger(__name__)


async def fetch_packs(
    packs: Sequence[PackRef], timeout: float | None, what: str, errors: dict[int, str]
) -> list[FetchedPack]:
    """The packs' values; the keys of a pack that cannot be read (within
    ``timeout`` seconds) get ``what`` in ``errors``."""
    if not packs:
        return []
    values = await asyncio.gather(*(_fetch(p.ref, timeout) for p in packs), return_exceptions=True)
    return copying.received(packs, values, what, errors)


async def _fetch(ref: object, timeout: float | None) -> object:
    if not isinstance(ref, ray.ObjectRef):
        raise TypeError(f"not an ObjectRef: {type(ref).__name__}")
    return await (asyncio.wait_for(ref, timeout) if timeout else ref)


class PeerFetcher:
    """Asks other nodes' object store actors for the packs of a load's keys."""

    def __init__(self, actor_name: str, node_id: str, namespace: str, timeout_s: float, counters: Counter[str]) -> None:
        self.actor_name = actor_name  # ours: never asked
        self.node_id = node_id
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.counters = counters
        self._peers: dict[str, ActorHandle] = {}

    async def find(
        self,
        directory: DirectoryClient,
        keys: Sequence[bytes],
        wanted: list[int],
        sources: dict[str, list[int]],
        errors: dict[int, str],
    ) -> list[PackRef]:
        """Refs of the packs that other nodes' actors hold for ``keys[wanted]``
        (two rounds: see ``peers``); keys nobody had get an error."""
        search = PeerSearch(self.actor_name, self.node_id, keys, wanted)
        search.follow_hints(sources)
        unhinted = search.unhinted()
        if unhinted:
            search.route(unhinted, await self._lookup(directory, search.keys_at(unhinted)))
        await self._ask_peers(search)
        retry = search.retry()
        if retry:
            search.route(retry, await self._lookup(directory, search.keys_at(retry)))
            await self._ask_peers(search)
        for i in search.missing():
            errors.setdefault(i, "not held by any object store actor")
        return search.found

    async def _lookup(self, directory: DirectoryClient, keys: list[bytes]) -> list[list[HolderInfo]]:
        """The directory's holders of ``keys`` (none when the lookup fails)."""
        self.counters["directory_lookups"] += 1
        try:
            return await directory.lookup_async(keys).result_async(self.timeout_s)
        except Exception as e:
            logger.warning("directory lookup for a load failed: %r", e)
            return []

    async def _ask_peers(self, search: PeerSearch) -> None:
        """Ask each peer ``search`` names now (one call each) for its packs."""
        todo = search.take_todo()
        names = list(todo)
        answers = await asyncio.gather(
            *(self._refs_at(name, search.keys_at(todo[name])) for name in names), return_exceptions=True
        )
        for name, answer in zip(names, answers):
            if isinstance(answer, BaseException):
                self._peers.pop(name, None)
                logger.info("object store peer %s unavailable: %r", name, answer)
            else:
                search.answered(todo[name], answer)

    async def relay_pins(self, directory: DirectoryClient, batch: PinBatch) -> int:
        """Send ``batch``'s pins (keys this node's actor does not hold) to every other
        node's object store actor the directory names as a holder, not to be relayed
        again; how many pins went out. Best effort: a failure is logged."""
        holders = await self._lookup(directory, list(batch.keys))
        per_peer: dict[str, tuple[list[bytes], list[float]]] = {}
        for key, ttl, hs in zip(batch.keys, batch.ttls, holders):
            for h in hs:
                if is_peer(h, {self.actor_name}):
                    keys, ttls = per_peer.setdefault(h.actor_name, ([], []))
                    keys.append(key)
                    ttls.append(ttl)
        sent = 0
        for name, (keys, ttls) in per_peer.items():
            try:
                handle = await self._handle(name)
                await asyncio.wait_for(
                    handle.pin.remote(PinBatch(tuple(keys), tuple(ttls), relay=False)), self.timeout_s
                )
                sent += len(keys)
            except Exception as e:  # noqa: BLE001 - a pin not relayed costs its lifetime, never bytes
                self._peers.pop(name, None)
                logger.info("pins not relayed to object store peer %s: %r", name, e)
        self.counters["pins_relayed"] += sent
        return sent

    async def _handle(self, actor_name: str) -> ActorHandle:
        handle = self._peers.get(actor_name)
        if handle is None:  # a GCS lookup: off the event loop
            handle = await asyncio.to_thread(ray.get_actor, actor_name, namespace=self.namespace)
            self._peers[actor_name] = handle
        return handle

    async def _refs_at(self, actor_name: str, keys: list[bytes]) -> list[PackRef]:
        """Another node's actor's ``get_refs`` answer for ``keys``."""
        handle = await self._handle(actor_name)
        ref: ray.ObjectRef[list[PackRef]] = handle.get_refs.remote(keys)
        return await asyncio.wait_for(ref, self.timeout_s)
