"""Engine-resident blocks in the directory: what each engine holds in its own KV cache.

An engine's own (accelerator) cache is the cheapest hit of all, but no tier
loads from it: it is recorded only so that a request router can send a request
to the replica that already holds its prefix (``raykv.serve.routing``).

- Keys live in their own family, ``engine_key(tag, block_hash)``: the identity
  tag, the low 8 bytes of vLLM's block hash (what vLLM's KV events carry by
  default) and a group index vLLM never uses. Tier lookups never see them.
- ``EngineCacheActor`` is the holder of one engine's keys: a ``HolderActor``
  with the ENGINE medium, fed by the engine's KV events (``apply``). The engine
  process that creates it owns it (not detached), so it dies with the engine,
  and the directory shards, which watch every holder, drop its entries at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import ray

from raykv.core.wire import ENGINE, HolderInfo, Report
from raykv.holders.holder_actor import HolderActor, process_holder_info

TIER_TYPE = "engine"
#: The group index of engine keys (vLLM's KV-cache groups count from 0).
ENGINE_GROUP = b"\xff\xff\xff\xff"
#: Bytes of a block hash an engine key keeps (vLLM's int block hashes are these).
HASH_BYTES = 8


def engine_key(tag: bytes, block_hash: bytes | int) -> bytes:
    """The directory key for "an engine of identity ``tag`` holds this block":
    ``block_hash`` is vLLM's hash (bytes), or the int its KV events carry."""
    if isinstance(block_hash, int):
        low = (block_hash & 0xFFFFFFFFFFFFFFFF).to_bytes(HASH_BYTES, "big")
    else:
        low = bytes(block_hash[-HASH_BYTES:]).rjust(HASH_BYTES, b"\0")
    return tag + low + ENGINE_GROUP


def engine_keys(tag: bytes, block_hashes: Iterable[bytes | int]) -> list[bytes]:
    """``engine_key`` of each hash."""
    return [engine_key(tag, h) for h in block_hashes]


def holder_info(namespace: str, node_id: str, owner: str | None, pid: int | None = None) -> HolderInfo:
    """The directory holder of the engine process ``pid`` (default: this one)."""
    return process_holder_info(TIER_TYPE, ENGINE, namespace, node_id, owner, pid)


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
class EngineCacheActor(HolderActor):
    """The blocks one engine holds in its own KV cache, as its KV events say."""

    def __init__(self, info: HolderInfo, namespace: str) -> None:
        super().__init__(
            info,
            namespace,
            {"stored": "raykv_tier_stored_blocks", "removed": "raykv_tier_evicted_blocks"},
        )
        self.requested_capacity = 0  # no capacity of its own: the engine's cache
        self._keys: set[bytes] = set()
        self._last_event = 0.0
        self._batches = 0
        #: blocks the engine loaded from each raykv tier (its hits by source, as it last said)
        self.loaded_by_tier: dict[str, int] = {}

    def __repr__(self) -> str:
        info = self.__dict__.get("info")
        owner = getattr(info, "owner", None) or "-"
        return f"EngineCache(node={str(getattr(info, 'node_id', '?'))[:12]}, replica={owner[:12]})"

    def held_keys(self) -> list[bytes]:
        return list(self._keys)

    def occupancy(self) -> tuple[int, int, int]:
        return len(self._keys), 0, 0

    def status_line(self) -> str:
        keys = self.__dict__.get("_keys", ())
        return f"engine cache {self.info.holder_id}: {len(keys)} blocks, {self._batches} event batches"

    def describe(self) -> Report:
        return {"node_id": self.info.node_id, "owner": self.info.owner}

    def tier_stats(self) -> Report:
        loaded: Report = {tier: n for tier, n in self.loaded_by_tier.items()}
        return {
            "blocks": len(self._keys),
            "event_batches": self._batches,
            "last_event_at": self._last_event,
            "loaded_by_tier": loaded,
            **self.counters,
        }

    async def drop_identities(self, tags: Iterable[bytes]) -> int:
        """``raykv invalidate``: forget the blocks of identities ``tags`` (the
        engine keeps its cache; the directory stops naming it for them)."""
        await self._started
        prefixes = tuple(tags)
        gone = [k for k in self._keys if k.startswith(prefixes)]
        self._keys.difference_update(gone)
        self.log.append(True, gone)
        await self._unregister(gone)
        self._publish()
        return len(gone)

    async def apply(
        self,
        stored: list[bytes],
        removed: list[bytes],
        cleared: bool = False,
        loaded_by_tier: dict[str, int] | None = None,
    ) -> int:
        """One batch of the engine's KV events, in order: everything cleared
        first (when ``cleared``), then ``removed``, then ``stored``. Index and
        directory change together (the calls leave before any await).
        ``loaded_by_tier``: the engine's blocks loaded from each raykv tier so far."""
        await self._started
        gone = list(self._keys) if cleared else []
        if cleared:
            self._keys.clear()
        gone += [k for k in removed if k in self._keys]
        self._keys.difference_update(removed)
        new = [k for k in stored if k not in self._keys]
        self._keys.update(new)
        self._batches += 1
        self._last_event = time.time()
        if loaded_by_tier:
            self.loaded_by_tier = dict(loaded_by_tier)
        self.counters["stored"] += len(new)
        self.counters["removed"] += len(gone)
        self.log.append(False, new)
        self.log.append(True, gone)
        # A key removed and stored again in one batch stays held: the directory is told
        # nothing about it (an unregister and a register sent together may run in either
        # order on the async shard actor).
        again = set(gone).intersection(new)
        if again:
            gone = [k for k in gone if k not in again]
            new = [k for k in new if k not in again]
        unregistered, registered = self._unregister(gone), self._register(new)
        await unregistered
        await registered
        self._publish()
        return len(self._keys)
