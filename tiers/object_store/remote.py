"""The Ray calls of a node actor's load: fetching packs, asking other nodes' actors.

``fetch_packs`` awaits packs' ObjectRefs (a zero-copy ``ray.get`` for this
node's plasma; a pull through Ray's object manager for another node's).
``PeerFetcher`` finds the packs of a load's missing keys at other nodes'
actors: ``PeerSearch`` decides whom to ask, ``PeerFetcher`` asks the
directory and the peers (``get_refs``) and keeps their actor handles.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

import ray
from ray.actor import ActorHandle

from raykv.core.wire import HolderInfo
from raykv.directory.client import DirectoryClient
from tiers.object_store import copying
from tiers.object_store.copying import FetchedPack
from tiers.object_store.messages import PackRef
from tiers.object_store.peers import PeerSearch

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

    async def _refs_at(self, actor_name: str, keys: list[bytes]) -> list[PackRef]:
        """Another node's actor's ``get_refs`` answer for ``keys``."""
        handle = self._peers.get(actor_name)
        if handle is None:  # a GCS lookup: off the event loop
            handle = await asyncio.to_thread(ray.get_actor, actor_name, namespace=self.namespace)
            self._peers[actor_name] = handle
        ref: ray.ObjectRef[list[PackRef]] = handle.get_refs.remote(keys)
        return await asyncio.wait_for(ref, self.timeout_s)
