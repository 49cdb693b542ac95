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
import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import ray
from ray.actor import ActorHandle

from raykv.core import naming
from raykv.core.restarting import await_riding_out_restart
from raykv.core.wire import PENDING, HolderInfo, LookupReply
from raykv.directory.feed import ChangeFeed
from raykv.directory.fingerprint import from_blob, to_blob
from raykv.directory.fptable import FingerprintTable
from raykv.directory.holdersets import HolderSets
from raykv.directory.messages import (
    DroppedHolder,
    FeedOp,
    FeedPage,
    RebuildReport,
    ShardBatch,
    ShardBatchReply,
    ShardFigures,
    ShardStats,
)
from raykv.metrics import status_log
from raykv.metrics.recorders import publish_shard_metrics

logger = logging.getLogger(__name__)

#: Longest wait for the control actor or one holder while a shard rebuilds.
REBUILD_TIMEOUT_S = 3.0
#: Fault tests only: ``"<shard index>:<ms>[,...]"`` makes those shards answer every
#: register, unregister and lookup that much later (a slow shard, as Ray's own
#: ``RAY_testing_asio_delay_us`` slows its RPCs). Read when a shard starts.
TESTING_DELAY_ENV = "RAYKV_TESTING_SHARD_DELAY_MS"


def testing_delay_s(index: int, setting: str | None = None) -> float:
    """Seconds shard ``index`` waits before answering, from ``TESTING_DELAY_ENV`` (0: none)."""
    setting = os.environ.get(TESTING_DELAY_ENV, "") if setting is None else setting
    for part in filter(None, (p.strip() for p in setting.split(","))):
        shard, _, ms = part.partition(":")
        if shard.strip() == str(index):
            return max(0.0, float(ms)) / 1000.0
    return 0.0


#: Keys of a shard's calls: a fingerprint blob (``fingerprint.to_blob``), keys, or fingerprints.
Keys = bytes | Sequence[bytes] | np.ndarray


def distinct(fps: np.ndarray) -> np.ndarray:
    """The distinct fingerprints of a batch (sorting: faster here than ``np.unique``'s hashing)."""
    if len(fps) < 2:
        return fps
    fps = np.sort(fps)
    keep = np.empty(len(fps), dtype=bool)
    keep[0] = True
    np.not_equal(fps[1:], fps[:-1], out=keep[1:])
    return fps[keep]


class DirectoryShardImpl:
    """Plain-Python shard state (wrapped by the ``DirectoryShard`` actor).

    Keys are 64-bit fingerprints (``raykv.directory.fingerprint``) in a
    ``FingerprintTable``; each entry's value is an interned holder-set id
    (``HolderSets``). Every call handles its batch with numpy; Python work per
    call is per distinct holder set, not per key. Calls take keys as a blob of
    fingerprints (``fingerprint.to_blob``) or, from holders' resync, as keys.
    """

    def __init__(self, index: int, num_shards: int) -> None:
        self.index = index
        self.num_shards = num_shards
        self._table = FingerprintTable()
        self._sets = HolderSets()
        self._holders: dict[int, HolderInfo] = {}
        self._slot_of: dict[str, int] = {}
        self._count: dict[int, int] = {}  # keys per holder slot
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.num_keys = 0  # entries with at least one holder
        self.calls: Counter[str] = Counter()
        self.dropped: list[DroppedHolder] = []
        self.invalidated: Counter[str] = Counter()  # keys dropped, by reason (metrics)
        self.looked_up = 0  # keys looked up (metrics)
        self.found = 0  # keys looked up that some holder held (status line)
        #: Every change, in order, for the node agents' views (``raykv.directory.agent``).
        self.feed = ChangeFeed()

    @property
    def nbytes(self) -> int:
        """Bytes of the key index (the arrays; holder tables are negligible)."""
        return self._table.nbytes

    # -- holders ---------------------------------------------------------
    def add_holder(self, info: HolderInfo) -> int:
        slot = self._slot_of.get(info.holder_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else self._next_slot
            if slot == self._next_slot:
                self._next_slot += 1
            self._slot_of[info.holder_id] = slot
            self._count[slot] = 0
        self._holders[slot] = info
        self.feed.append(FeedOp.ADD_HOLDER, info.holder_id, info=info)
        return slot

    def drop_holder(self, holder_id: str, reason: str = "") -> int:
        slot = self._slot_of.pop(holder_id, None)
        if slot is None:
            return 0
        n = self._count.pop(slot, 0)
        self._holders.pop(slot, None)
        if n:
            values = self._table.values
            hit = np.flatnonzero(np.isin(values, self._sets.containing(slot)))
            new = self._sets.without_slot(values[hit], slot)
            values[hit] = new
            self.num_keys -= int(np.count_nonzero(new == 0))
        self._free_slots.append(slot)  # no entry names it any more
        self.invalidated[reason or "removed"] += n
        self.dropped.append(DroppedHolder(holder_id, n, reason, time.time()))
        del self.dropped[:-100]
        self.feed.append(FeedOp.DROP_HOLDER, holder_id)
        return n

    # -- keys ------------------------------------------------------------
    def register(self, holder_id: str, keys: Keys) -> int:
        slot = self._slot_of.get(holder_id)
        if slot is None:
            return 0  # holder unknown or already dropped: ignore late registrations
        fps = distinct(from_blob(keys))
        table = self._table
        table.reserve(len(fps))  # before ``find``: a rebuild moves slots
        pos = table.upsert(fps)
        cur = table.values[pos]
        fresh = ~self._sets.has(cur, slot)
        pos, cur = pos[fresh], cur[fresh]
        table.values[pos] = self._sets.with_slot(cur, slot)
        self.num_keys += int(np.count_nonzero(cur == 0))
        self._count[slot] += len(pos)
        if len(pos):
            self.feed.append(FeedOp.REGISTER, holder_id, to_blob(fps[fresh]))
        return len(pos)

    def claim(self, holder_id: str, key: Keys) -> int:
        """Register ``key`` (one key) for ``holder_id`` and return how many other
        holders listed it before: 0 means ``holder_id`` came first (compute once:
        the first engine to claim a pending key computes its block). -1: the
        holder is not known here, nothing registered."""
        slot = self._slot_of.get(holder_id)
        if slot is None:
            return -1
        fps = distinct(from_blob(key))
        pos = self._table.find(fps)
        ids = [int(self._table.values[p]) for p in pos if p >= 0]
        before = set().union(*(self._sets.slots(i) for i in ids if i))
        self.register(holder_id, fps)
        return len(before - {slot})

    def sync_holder(self, holder_id: str, keys: Keys) -> tuple[int, int]:
        """Make ``holder_id``'s keys here exactly ``keys`` (a holder repairing
        drift): returns (keys added, keys removed)."""
        want = distinct(from_blob(keys))
        stale = np.setdiff1d(self.holder_fingerprints(holder_id), want, assume_unique=True)
        removed = self.unregister(holder_id, stale) if len(stale) else 0
        return self.register(holder_id, want), removed

    def holder_count(self, holder_id: str) -> int | None:
        """Keys listed for ``holder_id`` (None: the holder is not known here)."""
        slot = self._slot_of.get(holder_id)
        return None if slot is None else self._count.get(slot, 0)

    def unregister(self, holder_id: str, keys: Keys) -> int:
        slot = self._slot_of.get(holder_id)
        if slot is None:
            return 0
        fps = distinct(from_blob(keys))
        pos = self._table.find(fps)
        fps, pos = fps[pos >= 0], pos[pos >= 0]
        held = self._sets.has(self._table.values[pos], slot)
        fps, pos = fps[held], pos[held]
        cur = self._table.values[pos]
        new = self._sets.without_slot(cur, slot)
        self._table.values[pos] = new
        self.num_keys -= int(np.count_nonzero(new == 0))
        self._count[slot] -= len(pos)
        self.invalidated["evicted"] += len(pos)
        if len(pos):
            self.feed.append(FeedOp.UNREGISTER, holder_id, to_blob(fps))
        return len(pos)

    def lookup(self, keys: Keys) -> LookupReply:
        """Per key a holder-set id (0: nobody) as a uint32 blob, each id's slots,
        and the slots' holders (``placement.decode_reply`` turns it into holders)."""
        fps = from_blob(keys)
        self.looked_up += len(fps)
        pos = self._table.find(fps)
        ids = np.where(pos >= 0, self._table.values[pos], 0).astype("<u4")
        self.found += int(np.count_nonzero(ids))
        sets = {int(i): tuple(sorted(self._sets.slots(i))) for i in self._sets.present(ids) if i}
        used: set[int] = set().union(*sets.values()) if sets else set()
        holders = {s: self._holders[s] for s in used}
        return LookupReply(ids.tobytes(), sets, holders, self.feed.epoch, self.feed.seq)

    def apply(self, batch: ShardBatch) -> ShardBatchReply:
        """A node agent's combined call: its key changes in order, the feed page after
        its position (these changes included), then its lookup (taken at the page's end)."""
        counts = tuple(
            self.register(op.holder_id, op.fps) if op.op == FeedOp.REGISTER else self.unregister(op.holder_id, op.fps)
            for op in batch.ops
        )
        page = self.changes(*batch.follow) if batch.follow is not None else None
        return ShardBatchReply(counts, self.lookup(batch.lookup) if batch.lookup else None, page)

    def changes(self, epoch: int, since: int) -> FeedPage:
        """The feed's entries after ``since`` (``ChangeFeed.page``)."""
        return self.feed.page(epoch, since, list(self._holders.values()))

    def holder_fingerprints(self, holder_id: str) -> np.ndarray:
        """Fingerprints of every key ``holder_id`` holds here."""
        slot = self._slot_of.get(holder_id)
        if slot is None:
            return np.zeros(0, dtype=np.uint64)
        table = self._table
        return table.flat_fps[np.isin(table.values, self._sets.containing(slot))].copy()

    @property
    def pending_keys(self) -> int:
        """Keys listed only as pending entries (their own key family: no holder holds one);
        a block two engines both compute counts twice."""
        n = sum(self._count[s] for s, info in self._holders.items() if info.medium == PENDING)
        return min(n, self.num_keys)

    @property
    def num_holders(self) -> int:
        return len(self._holders)

    def figures(self) -> ShardFigures:
        """What the shard's metrics publish: key, holder and lookup counts, invalidations by reason."""
        return ShardFigures(
            num_keys=self.num_keys - self.pending_keys,
            num_holders=self.num_holders,
            looked_up=self.looked_up,
            invalidated=dict(self.invalidated),
        )

    def stats(self) -> ShardStats:
        return ShardStats(
            shard=self.index,
            keys=self.num_keys - self.pending_keys,
            pending_keys=self.pending_keys,
            index_bytes=self.nbytes,
            holders={info.holder_id: self._count[s] for s, info in self._holders.items()},
            calls=dict(self.calls),
            dropped=list(self.dropped[-20:]),
        )


@ray.remote(num_cpus=0, max_restarts=-1)
class DirectoryShard:
    """Named actor ``raykv-directory-<i>``: one shard of the directory."""

    def __init__(self, index: int, num_shards: int, namespace: str | None = None) -> None:
        self._impl = DirectoryShardImpl(index, num_shards)
        self._watches: dict[str, asyncio.Task[None]] = {}
        self.namespace = namespace
        self.started_at = time.time()
        self.rebuild = RebuildReport()
        self._delay_s = testing_delay_s(index)
        #: Set (and replaced) at every change: wakes the agents' waiting ``changes`` calls.
        self._changed = asyncio.Event()
        if self._delay_s:
            logger.warning(
                "directory shard %d answers %.0f ms late (%s)", index, self._delay_s * 1e3, TESTING_DELAY_ENV
            )
        # Async actors run __init__ on their event loop: the rebuild is a task
        # that every method waits for (``_ready``); it never raises.
        self._rebuilt = asyncio.get_running_loop().create_task(self._rebuild())
        # Keys, lookups and invalidations as Ray metrics, published locally once a second.
        self._metrics_task = asyncio.get_running_loop().create_task(publish_shard_metrics(index, self._impl.figures))
        self._status_log = status_log.spawn(self.status_line, namespace=namespace)

    def __repr__(self) -> str:
        # What and where only (the dashboard records it once); works when __init__ raised early.
        impl = self.__dict__.get("_impl")
        where = f"{impl.index}/{impl.num_shards}" if impl is not None else "?"
        return f"DirectoryShard({where}, namespace {self.__dict__.get('namespace')!r})"

    def status_line(self) -> str:
        """Live keys, holders and lookups, one line (logged every ``status_log_s``)."""
        s = self._impl
        return (
            f"directory shard {s.index}/{s.num_shards}: {s.num_keys} keys, {s.num_holders} holders; "
            f"looked up {s.looked_up} keys, {s.found} found; registers {s.calls['register']}, "
            f"invalidated {sum(s.invalidated.values())}"
        )

    async def _ready(self) -> None:
        if not self._rebuilt.done():
            await asyncio.shield(self._rebuilt)

    async def _ready_to_answer(self) -> None:
        """``_ready``, then the fault tests' injected delay (``TESTING_DELAY_ENV``)."""
        await self._ready()
        if self._delay_s:
            await asyncio.sleep(self._delay_s)

    async def _rebuild(self) -> None:
        """Re-learn every live holder's keys of this shard (after a restart)."""
        t0 = time.monotonic()
        if self.namespace is None:
            return
        try:
            control = await asyncio.to_thread(ray.get_actor, naming.CONTROL_ACTOR, namespace=self.namespace)
            holders: list[HolderInfo] = await asyncio.wait_for(
                await_riding_out_restart(control.holders.remote), REBUILD_TIMEOUT_S
            )
        except Exception as e:  # no control actor (yet): nothing to rebuild from
            self.rebuild = RebuildReport(error=repr(e))
            return
        index, num_shards = self._impl.index, self._impl.num_shards

        async def ask(holder: HolderInfo) -> tuple[ActorHandle, tuple[HolderInfo, list[bytes]]]:
            handle = await asyncio.to_thread(ray.get_actor, holder.actor_name, namespace=holder.namespace)
            reply: tuple[HolderInfo, list[bytes]] = await asyncio.wait_for(
                handle.raykv_resync.remote(index, num_shards), REBUILD_TIMEOUT_S
            )
            return handle, reply

        replies = await asyncio.gather(*(ask(h) for h in holders), return_exceptions=True)
        rebuilt, keys_added, failed = 0, 0, list[str]()
        for announced, reply in zip(holders, replies):
            if isinstance(reply, BaseException):  # dead or unreachable: nothing to serve from it
                failed.append(f"{announced.holder_id}: {type(reply).__name__}")
                continue
            handle, (holder, keys) = reply
            self._watch_holder(holder, handle)
            rebuilt += 1
            keys_added += self._impl.register(holder.holder_id, keys)
        self.rebuild = RebuildReport(rebuilt, keys_added, tuple(failed), time.monotonic() - t0)
        if rebuilt or failed:
            logger.info("directory shard %d rebuilt: %s", index, self.rebuild)

    def _watch_holder(self, holder: HolderInfo, handle: ActorHandle) -> None:
        self._impl.add_holder(holder)
        old = self._watches.pop(holder.holder_id, None)
        if old is not None:
            old.cancel()
        self._watches[holder.holder_id] = asyncio.get_running_loop().create_task(self._watch(holder.holder_id, handle))

    async def add_holder(self, info: HolderInfo, handle: ActorHandle) -> None:
        """A holder (re)announces itself as it starts: whatever an earlier life
        of it registered is dropped (its old watch may not have errored yet)."""
        await self._ready()
        self._impl.calls["add_holder"] += 1
        self._impl.drop_holder(info.holder_id, reason="re-added")
        self._watch_holder(info, handle)
        self._notify()

    async def _watch(self, holder_id: str, handle: ActorHandle) -> None:
        try:
            await handle.raykv_watch.remote()
        except asyncio.CancelledError:
            return
        except Exception as e:  # the holder's actor died (or its node did)
            n = self._impl.drop_holder(holder_id, reason=type(e).__name__)
            self._notify()
            logger.info("holder %s died (%s): dropped %d keys", holder_id, type(e).__name__, n)
        self._watches.pop(holder_id, None)

    async def remove_holder(self, holder_id: str, reason: str = "removed") -> int:
        await self._ready()
        self._impl.calls["remove_holder"] += 1
        task = self._watches.pop(holder_id, None)
        if task is not None:
            task.cancel()
        try:
            return self._impl.drop_holder(holder_id, reason)
        finally:
            self._notify()

    async def register(self, holder_id: str, keys: Keys) -> int:
        await self._ready_to_answer()
        self._impl.calls["register"] += 1
        try:
            return self._impl.register(holder_id, keys)
        finally:
            self._notify()

    async def claim(self, holder_id: str, key: Keys) -> int:
        """``DirectoryShardImpl.claim``: register one key, and say who listed it first."""
        await self._ready_to_answer()
        self._impl.calls["claim"] += 1
        try:
            return self._impl.claim(holder_id, key)
        finally:
            self._notify()

    async def unregister(self, holder_id: str, keys: Keys) -> int:
        await self._ready_to_answer()
        self._impl.calls["unregister"] += 1
        try:
            return self._impl.unregister(holder_id, keys)
        finally:
            self._notify()

    async def holder_counts(self, holder_id: str) -> int | None:
        """Keys listed for ``holder_id`` here (None: unknown holder): holders compare it with their own."""
        await self._ready()
        return self._impl.holder_count(holder_id)

    async def sync_holder(self, holder: HolderInfo, handle: ActorHandle, keys: Keys) -> tuple[int, int]:
        """A live holder's full listing for this shard: (re)watch it and make its
        keys here exactly ``keys``. Repairs drift (a watch that failed although
        the holder lives, a rebuild that could not reach it, a lost call)."""
        await self._ready()
        self._impl.calls["sync_holder"] += 1
        if self._impl.holder_count(holder.holder_id) is None or holder.holder_id not in self._watches:
            self._watch_holder(holder, handle)
        added, removed = self._impl.sync_holder(holder.holder_id, keys)
        self._notify()
        if added or removed:
            logger.warning(
                "directory shard %d: holder %s was out of sync (+%d / -%d keys); repaired",
                self._impl.index,
                holder.holder_id,
                added,
                removed,
            )
        return added, removed

    async def lookup(self, keys: Keys) -> LookupReply:
        await self._ready_to_answer()
        self._impl.calls["lookup"] += 1
        return self._impl.lookup(keys)

    async def apply(self, batch: ShardBatch) -> ShardBatchReply:
        """A node agent's combined call for one window (``DirectoryShardImpl.apply``)."""
        await self._ready_to_answer()
        self._impl.calls["apply"] += 1
        try:
            return self._impl.apply(batch)
        finally:
            self._notify()

    def _notify(self) -> None:
        """Wake the readers of the change feed waiting in ``changes``."""
        if self._impl.feed.seq != self._notified:
            self._notified = self._impl.feed.seq
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    _notified = 0

    async def changes(self, epoch: int, since: int, wait_s: float = 1.0) -> FeedPage:
        """The change feed after ``since`` (``ChangeFeed.page``); when there is
        nothing new yet, wait up to ``wait_s`` for it (one call per reader in flight)."""
        await self._ready()
        self._impl.calls["changes"] += 1
        feed = self._impl.feed
        if epoch == feed.epoch and since == feed.seq and wait_s > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self._impl.changes(epoch, since)

    async def holder_fingerprints(self, holder_id: str) -> np.ndarray:
        """Fingerprints (``raykv.directory.fingerprint``) of ``holder_id``'s keys here."""
        await self._ready()
        return self._impl.holder_fingerprints(holder_id)

    async def stats(self) -> ShardStats:
        await self._ready()
        return dataclasses.replace(self._impl.stats(), started_at=self.started_at, rebuild=self.rebuild)

    async def ping(self) -> bool:
        await self._ready()
        return True
