"""A directory shard: key -> holders for the keys whose hash falls in this shard.

An async actor. Each holder's actor is watched with a call that never returns
(``raykv_watch``); when the holder dies that call errors and every entry of
the holder is dropped at once, with no timeout involved.

A shard keeps no state on disk: when it (re)starts (Ray restarts it after a
crash, ``max_restarts=-1``) it rebuilds its entries from the holders
themselves. It asks the control actor for the holder list, asks each live
holder for its keys of this shard (``raykv_resync``) and watches it again.
Every other call waits until that rebuild is over, so registrations racing
with it are applied after it, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import ray

from raykv import naming, status_log
from raykv.directory.holders import HolderInfo
from raykv.metrics import publish_shard_metrics

logger = logging.getLogger(__name__)

#: Longest wait for the control actor or one holder while a shard rebuilds.
REBUILD_TIMEOUT_S = 3.0


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
        self.invalidated: Counter[str] = Counter()  # keys dropped, by reason (metrics)
        self.looked_up = 0  # keys looked up (metrics)
        self.found = 0  # keys looked up that some holder held (status line)

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
        self.invalidated[reason or "removed"] += len(keys)
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
        fresh = set(keys)  # set algebra and map run per key in C
        fresh -= owned
        if not fresh:
            return 0
        owned |= fresh
        current = list(map(entries.get, fresh))
        if current.count(None) == len(current):  # the usual case: nobody held them
            entries.update(dict.fromkeys(fresh, slot))
            return len(fresh)
        for key, cur in zip(fresh, current):
            if cur is None:
                entries[key] = slot
            elif isinstance(cur, int):
                entries[key] = (cur, slot)
            else:
                entries[key] = (*cur, slot)
        return len(fresh)

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
        self.invalidated["evicted"] += removed
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
        self.looked_up += len(keys)
        out = list(map(entries.get, keys))  # per key in C
        self.found += len(out) - out.count(None)
        used: set[int] = set()
        for v in set(out):  # distinct answers: a handful
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

    def __init__(self, index: int, num_shards: int, namespace: str | None = None) -> None:
        self._impl = DirectoryShardImpl(index, num_shards)
        self._watches: dict[str, asyncio.Task] = {}
        self.namespace = namespace
        self.started_at = time.time()
        self.rebuild: dict[str, Any] = {}
        # Async actors run __init__ on their event loop: the rebuild is a task
        # that every method waits for (``_ready``); it never raises.
        self._rebuilt = asyncio.get_running_loop().create_task(self._rebuild())
        # Keys, lookups and invalidations as Ray metrics, published locally once a second.
        self._metrics_task = asyncio.get_running_loop().create_task(publish_shard_metrics(self._impl))
        self._status_log = status_log.spawn(self.status_line, namespace=namespace)

    def __repr__(self) -> str:
        s = self._impl
        return f"DirectoryShard({s.index}/{s.num_shards}, keys={len(s._entries)}, holders={len(s._holders)})"

    def status_line(self) -> str:
        """Live keys, holders and lookups, one line (logged every ``status_log_s``)."""
        s = self._impl
        return (
            f"directory shard {s.index}/{s.num_shards}: {len(s._entries)} keys, {len(s._holders)} holders; "
            f"looked up {s.looked_up} keys, {s.found} found; registers {s.calls['register']}, "
            f"invalidated {sum(s.invalidated.values())}"
        )

    async def _ready(self) -> None:
        if not self._rebuilt.done():
            await asyncio.shield(self._rebuilt)

    async def _rebuild(self) -> None:
        """Re-learn every live holder's keys of this shard (after a restart)."""
        t0 = time.monotonic()
        out: dict[str, Any] = {"holders": 0, "keys": 0, "failed": [], "seconds": 0.0}
        self.rebuild = out
        if self.namespace is None:
            return
        try:
            control = await asyncio.to_thread(ray.get_actor, naming.CONTROL_ACTOR, namespace=self.namespace)
            holders = await asyncio.wait_for(control.holders.remote(), REBUILD_TIMEOUT_S)
        except Exception as e:  # no control actor (yet): nothing to rebuild from
            out["error"] = repr(e)
            return
        index, num_shards = self._impl.index, self._impl.num_shards

        async def ask(raw: dict[str, Any]) -> tuple[Any, Any]:
            handle = await asyncio.to_thread(ray.get_actor, raw["actor_name"], namespace=raw["namespace"])
            reply = await asyncio.wait_for(handle.raykv_resync.remote(index, num_shards), REBUILD_TIMEOUT_S)
            return handle, reply

        replies = await asyncio.gather(*(ask(h) for h in holders), return_exceptions=True)
        for raw, reply in zip(holders, replies):
            if isinstance(reply, BaseException):  # dead or unreachable: nothing to serve from it
                out["failed"].append(f"{raw.get('holder_id')}: {type(reply).__name__}")
                continue
            handle, (info, keys) = reply
            holder = HolderInfo.from_dict(info)
            self._watch_holder(holder, handle)
            out["holders"] += 1
            out["keys"] += self._impl.register(holder.holder_id, keys)
        out["seconds"] = time.monotonic() - t0
        if out["holders"] or out["failed"]:
            logger.info("directory shard %d rebuilt: %s", index, out)

    def _watch_holder(self, holder: HolderInfo, handle: Any) -> None:
        self._impl.add_holder(holder)
        old = self._watches.pop(holder.holder_id, None)
        if old is not None:
            old.cancel()
        self._watches[holder.holder_id] = asyncio.get_running_loop().create_task(
            self._watch(holder.holder_id, handle)
        )

    async def add_holder(self, info: dict[str, Any], handle: Any) -> None:
        """A holder (re)announces itself as it starts: whatever an earlier life
        of it registered is dropped (its old watch may not have errored yet)."""
        await self._ready()
        self._impl.calls["add_holder"] += 1
        holder = HolderInfo.from_dict(info)
        self._impl.drop_holder(holder.holder_id, reason="re-added")
        self._watch_holder(holder, handle)

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
        await self._ready()
        self._impl.calls["remove_holder"] += 1
        task = self._watches.pop(holder_id, None)
        if task is not None:
            task.cancel()
        return self._impl.drop_holder(holder_id, reason)

    async def register(self, holder_id: str, keys: list[bytes]) -> int:
        await self._ready()
        self._impl.calls["register"] += 1
        return self._impl.register(holder_id, keys)

    async def unregister(self, holder_id: str, keys: list[bytes]) -> int:
        await self._ready()
        self._impl.calls["unregister"] += 1
        return self._impl.unregister(holder_id, keys)

    async def lookup(self, keys: list[bytes]) -> tuple[list[Any], dict[int, dict[str, Any]]]:
        await self._ready()
        self._impl.calls["lookup"] += 1
        return self._impl.lookup(keys)

    async def holder_keys(self, holder_id: str) -> list[bytes]:
        await self._ready()
        return self._impl.holder_keys(holder_id)

    async def stats(self) -> dict[str, Any]:
        await self._ready()
        return {**self._impl.stats(), "started_at": self.started_at, "rebuild": dict(self.rebuild)}

    async def ping(self) -> bool:
        await self._ready()
        return True
