"""A directory shard: key -> holders for the keys whose hash falls in this shard.

An async actor. Each holder's actor is watched with a call that never returns
(``raykv_watch``); when the holder dies that call errors and every entry of
the holder is dropped at once, with no timeout involved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import ray

from raykv.directory.holders import HolderInfo

logger = logging.getLogger(__name__)


class DirectoryShardImpl:
    """Plain-Python shard state (wrapped by the ``DirectoryShard`` actor)."""

    def __init__(self, index: int, num_shards: int) -> None:
        self.index = index
        self.num_shards = num_shards
        # key -> holder slot (int) or tuple of slots when several tiers hold it.
        self._entries: dict[bytes, int | tuple[int, ...]] = {}
        self._holder_keys: dict[int, set[bytes]] = {}
        self._holders: dict[int, HolderInfo] = {}
        self._slot_of: dict[str, int] = {}
        self._next_slot = 0
        self.calls: Counter[str] = Counter()
        self.dropped: list[dict[str, Any]] = []

    # -- holders ---------------------------------------------------------
    def add_holder(self, info: HolderInfo) -> int:
        slot = self._slot_of.get(info.holder_id)
        if slot is None:
            slot = self._next_slot
            self._next_slot += 1
            self._slot_of[info.holder_id] = slot
            self._holder_keys[slot] = set()
        self._holders[slot] = info
        return slot

    def drop_holder(self, holder_id: str, reason: str = "") -> int:
        slot = self._slot_of.pop(holder_id, None)
        if slot is None:
            return 0
        keys = self._holder_keys.pop(slot, set())
        self._holders.pop(slot, None)
        for key in keys:
            self._remove(key, slot)
        self.dropped.append({"holder_id": holder_id, "keys": len(keys), "reason": reason, "at": time.time()})
        return len(keys)

    # -- keys ------------------------------------------------------------
    def register(self, holder_id: str, keys: list[bytes]) -> int:
        slot = self._slot_of.get(holder_id)
        if slot is None:
            return 0  # holder unknown or already dropped: ignore late registrations
        owned = self._holder_keys[slot]
        entries = self._entries
        added = 0
        for key in keys:
            if key in owned:
                continue
            owned.add(key)
            added += 1
            cur = entries.get(key)
            if cur is None:
                entries[key] = slot
            elif isinstance(cur, int):
                entries[key] = (cur, slot)
            else:
                entries[key] = (*cur, slot)
        return added

    def unregister(self, holder_id: str, keys: list[bytes]) -> int:
        slot = self._slot_of.get(holder_id)
        if slot is None:
            return 0
        owned = self._holder_keys[slot]
        removed = 0
        for key in keys:
            if key in owned:
                owned.discard(key)
                self._remove(key, slot)
                removed += 1
        return removed

    def _remove(self, key: bytes, slot: int) -> None:
        cur = self._entries.get(key)
        if cur is None:
            return
        if isinstance(cur, int):
            if cur == slot:
                del self._entries[key]
            return
        rest = tuple(s for s in cur if s != slot)
        if not rest:
            del self._entries[key]
        else:
            self._entries[key] = rest[0] if len(rest) == 1 else rest

    def lookup(self, keys: list[bytes]) -> tuple[list[Any], dict[int, dict[str, Any]]]:
        """Per key: None, a holder slot or a tuple of slots; plus the slots' holders."""
        entries = self._entries
        out = [entries.get(k) for k in keys]
        used: set[int] = set()
        for v in out:
            if v is None:
                continue
            if isinstance(v, int):
                used.add(v)
            else:
                used.update(v)
        return out, {s: self._holders[s].to_dict() for s in used}

    def holder_keys(self, holder_id: str) -> list[bytes]:
        slot = self._slot_of.get(holder_id)
        return list(self._holder_keys.get(slot, ())) if slot is not None else []

    def stats(self) -> dict[str, Any]:
        return {
            "shard": self.index,
            "keys": len(self._entries),
            "holders": {
                info.holder_id: len(self._holder_keys[s]) for s, info in self._holders.items()
            },
            "calls": dict(self.calls),
            "dropped": list(self.dropped[-20:]),
        }


@ray.remote(num_cpus=0, max_restarts=-1)
class DirectoryShard:
    """Named actor ``raykv-directory-<i>``: one shard of the directory."""

    def __init__(self, index: int, num_shards: int) -> None:
        self._impl = DirectoryShardImpl(index, num_shards)
        self._watches: dict[str, asyncio.Task] = {}

    def __repr__(self) -> str:
        s = self._impl
        return f"DirectoryShard({s.index}/{s.num_shards}, keys={len(s._entries)}, holders={len(s._holders)})"

    async def add_holder(self, info: dict[str, Any], handle: Any) -> None:
        self._impl.calls["add_holder"] += 1
        holder = HolderInfo.from_dict(info)
        self._impl.add_holder(holder)
        old = self._watches.pop(holder.holder_id, None)
        if old is not None:
            old.cancel()
        self._watches[holder.holder_id] = asyncio.get_running_loop().create_task(
            self._watch(holder.holder_id, handle)
        )

    async def _watch(self, holder_id: str, handle: Any) -> None:
        try:
            await handle.raykv_watch.remote()
        except asyncio.CancelledError:
            return
        except Exception as e:  # the holder's actor died (or its node did)
            n = self._impl.drop_holder(holder_id, reason=type(e).__name__)
            logger.info("holder %s died (%s): dropped %d keys", holder_id, type(e).__name__, n)
        self._watches.pop(holder_id, None)

    async def remove_holder(self, holder_id: str, reason: str = "removed") -> int:
        self._impl.calls["remove_holder"] += 1
        task = self._watches.pop(holder_id, None)
        if task is not None:
            task.cancel()
        return self._impl.drop_holder(holder_id, reason)

    async def register(self, holder_id: str, keys: list[bytes]) -> int:
        self._impl.calls["register"] += 1
        return self._impl.register(holder_id, keys)

    async def unregister(self, holder_id: str, keys: list[bytes]) -> int:
        self._impl.calls["unregister"] += 1
        return self._impl.unregister(holder_id, keys)

    async def lookup(self, keys: list[bytes]) -> tuple[list[Any], dict[int, dict[str, Any]]]:
        self._impl.calls["lookup"] += 1
        return self._impl.lookup(keys)

    async def holder_keys(self, holder_id: str) -> list[bytes]:
        return self._impl.holder_keys(holder_id)

    async def stats(self) -> dict[str, Any]:
        return self._impl.stats()

    async def ping(self) -> bool:
        return True
