"""``FsRootActor``: the owner of one shared-storage root.

One detached actor per root (named ``naming.fs_actor(root)``) keeps the index
of block files (``index.RootIndex``: key -> file size, in LRU order) and the
root's byte capacity. Engines write block files themselves (no bytes pass
through this actor) and then ``commit`` the keys in one call per job batch
(``messages.CommitBatch``); the actor registers them at the directory, evicts
least-recently-used files to stay within capacity (deleting the files and
unregistering the keys) and answers which keys did not stay
(``messages.CommitReport``). It is the directory's holder for the root
(medium SHARED), so when it dies the directory drops every key of the root at
once; when it (re)starts it scans the root and registers what is there, so a
restart loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import cast

import ray
from ray.actor import ActorClass, ActorHandle

from raykv.core import naming
from raykv.core.handles import HolderHandle
from raykv.core.pins import REFUSED_COUNTERS, PinBatch, Unpin
from raykv.core.placement import SHARED, HolderInfo
from raykv.core.tenants import TenantLRU, fmt_tenants
from raykv.core.units import fmt_bytes
from raykv.core.wire import Report
from raykv.holders.holder_actor import HolderActor, runs_to_end
from raykv.metrics.incidents import Removal, RemovalLog
from tiers.fs.index import RootIndex
from tiers.fs.messages import CommitBatch, CommitReport, FsRootSettings
from tiers.fs.storage import open_storage

logger = logging.getLogger(__name__)

REGISTER_BATCH = 20_000
#: Concurrent calls a root actor serves (every engine of the cluster commits, touches, removes).
MAX_CONCURRENCY = 10_000
#: Shortest pause between two sweeps of writers' temp files (a tiny ``tmp_max_age_s``, in tests).
TMP_SWEEP_MIN_S = 0.5


def holder_info(root: str, namespace: str) -> HolderInfo:
    """The directory holder of a (canonical) root."""
    return HolderInfo(f"fs:{naming.root_digest(root)}", "fs", SHARED, naming.fs_actor(root), namespace, None)


#: The actor's counters exported as raykv's tier metrics (tier fs, node "shared").
METRIC_COUNTERS = {
    "committed": "raykv_tier_stored_blocks",
    "evicted": "raykv_tier_evicted_blocks",
    "removed": "raykv_tier_removed_blocks",
}


def start_root_actor(settings: FsRootSettings, namespace: str) -> HolderHandle:
    """Start (or find) the detached actor of ``settings.root``; returns its handle."""
    # mypy does not apply class decorators: @ray.remote made the class an ActorClass.
    actor_class = cast("ActorClass[FsRootActor]", FsRootActor)
    handle = actor_class.options(
        name=naming.fs_actor(settings.root), namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(settings, namespace)
    assert isinstance(handle, ActorHandle)  # Ray's stubs also allow the class itself
    return handle


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=MAX_CONCURRENCY)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
class FsRootActor(HolderActor):
    """Index, capacity and directory registration of one root's block files."""

    #: Block files outlive the actor: a restart scans and re-registers them.
    BLOCKS_DIE_WITH_ACTOR = False

    def __init__(self, settings: FsRootSettings, namespace: str) -> None:
        super().__init__(holder_info(settings.root, namespace), namespace, METRIC_COUNTERS)
        self.settings = settings
        self.root = settings.root
        self.requested_capacity = int(settings.capacity_bytes)
        self.index = RootIndex(settings.capacity_bytes, settings.tenant_quotas, settings.max_pinned_fraction)
        self.storage = open_storage(self.root)
        self.storage.ensure_root()
        self.counters.update(
            dict.fromkeys(
                ("commits", "committed", "evicted", "removed", "invalidated", "touches", "directory_errors"), 0
            )
        )
        self.counters.update(dict.fromkeys(("pins_granted", "unpinned", *REFUSED_COUNTERS.values()), 0))
        self.removed_reasons: Counter[str] = Counter()
        #: Every removed file counted (by reason) and logged with its key and path.
        self.removals = RemovalLog(f"fs root {self.root}", self._metrics.tags)
        self.scanned = 0

    async def recover(self) -> None:
        """Scan the root and register every block file found (oldest first in LRU)."""
        t0 = time.monotonic()
        entries = await asyncio.to_thread(self.storage.scan, self.settings.tmp_max_age_s)
        for reason, found in self.storage.scan_removals().items():
            self.removed_reasons[reason] += len(found)
            self.removals.note(reason, found)
        evicted = self._evicted(self.index.adopt(entries))
        if evicted:
            await asyncio.to_thread(self.storage.delete, evicted)
        keys = self.index.keys()
        for i in range(0, len(keys), REGISTER_BATCH):
            await self._register(keys[i : i + REGISTER_BATCH])
        self.scanned = len(entries)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_tmp_forever())
        logger.info(
            "fs root %s: found %d block files (%s) in %.2fs, evicted %d over capacity",
            self.root,
            len(entries),
            fmt_bytes(self.index.bytes),
            time.monotonic() - t0,
            len(evicted),
        )

    async def _sweep_tmp_forever(self) -> None:
        """While the actor lives: remove temp files of writers killed mid-store (older than
        ``tmp_max_age_s``), every quarter of that age, so they never pile up outside the
        capacity for longer than about 1.25x it (before, only a restarted actor removed them)."""
        age = self.settings.tmp_max_age_s
        while True:
            try:
                removed = await asyncio.to_thread(self.storage.sweep_tmp, age)
            except Exception as e:  # noqa: BLE001 - a failed sweep is retried; blocks are unaffected
                logger.warning("fs root %s: temp file sweep failed: %r", self.root, e)
                removed = []
            if removed:  # counted and logged as the start-up scan's are
                self.removed_reasons["stale_tmp"] += len(removed)
                self.removals.note("stale_tmp", [Removal("?", p, f"temp file older than {age:g} s") for p in removed])
            await asyncio.sleep(max(TMP_SWEEP_MIN_S, age / 4))

    def __repr__(self) -> str:
        # What and where only: the dashboard records a repr once, at start (live
        # figures: `raykv status`, metrics). Must work when __init__ raised early.
        settings, index = self.__dict__.get("settings"), self.__dict__.get("index")
        root = settings.root if isinstance(settings, FsRootSettings) else "?"
        cap = index.capacity if isinstance(index, RootIndex) else None
        return f"FsRoot({root}, capacity {'?' if cap is None else fmt_bytes(cap) if cap else 'unlimited'})"

    def status_line(self) -> str:
        c, index = self.counters, self.index
        cap = (
            f"{fmt_bytes(index.capacity)} ({100 * index.bytes / index.capacity:.0f}%)"
            if index.capacity
            else "unlimited"
        )
        return (
            f"fs root={self.root}: {len(index)} files, {fmt_bytes(index.bytes)} / {cap}; "
            f"committed {c['committed']}, evicted {c['evicted']}, removed {c['removed']}, touches {c['touches']}"
            f"{fmt_tenants(index.tenants.bytes_by_tenant())}"
        )

    def held_keys(self) -> list[bytes]:
        return self.index.keys()

    def occupancy(self) -> tuple[int, int, int]:
        return len(self.index), self.index.bytes, self.index.capacity

    def started_with(self) -> FsRootSettings:
        return self.settings

    def describe(self) -> Report:
        return {"root": self.root}

    # -- helpers -----------------------------------------------------------
    def _evicted(self, keys: list[bytes]) -> list[bytes]:
        """Count and log keys the index evicted."""
        self.counters["evicted"] += len(keys)
        self.log.append(True, keys)
        return keys

    def _dropped(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop keys from the index; the ones it held are logged and returned."""
        dropped = self.index.drop(keys)
        self.log.append(True, dropped)
        return dropped

    async def _delete_files(self, keys: Sequence[bytes]) -> None:
        # A key may be back (re-committed while we awaited): keep its file.
        gone = [k for k in keys if k not in self.index]
        if gone:
            await asyncio.to_thread(self.storage.delete, gone)

    async def _missing(self, keys: Sequence[bytes]) -> set[bytes]:
        """The ones of ``keys`` whose file this actor does not see."""
        sizes = await asyncio.to_thread(lambda: [self.storage.existing_size(k) for k in keys])
        return {k for k, size in zip(keys, sizes) if size is None}

    # -- API -----------------------------------------------------------------
    @runs_to_end
    async def commit(self, batch: CommitBatch) -> CommitReport:
        """Take the batch's keys (files written, or found present, by engines) into the index.

        Keys of ``batch.verify`` the index does not know are checked on disk
        first (the file may have been evicted in between) and reported as
        ``missing`` if gone; ``evicted`` may hold keys of this batch when the
        batch alone exceeds the capacity.
        """
        await self._started
        self.counters["commits"] += 1
        check = [k for k in batch.verify if k not in self.index]
        missing = await self._missing(check) if check else set()
        # From here to the first await the index and the directory calls change together.
        done = self.index.commit(batch, missing)
        done.pins.count_into(self.counters)
        self.counters["committed"] += done.added
        self._evicted(done.evicted)
        self.log.append(False, done.new)
        await asyncio.gather(self._register(done.held), self._unregister(done.evicted))
        if done.evicted:  # after the directory stopped pointing at them
            await self._delete_files(done.evicted)
        self._publish()
        return CommitReport(tuple(done.evicted), tuple(missing))

    async def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys recently used (LRU)."""
        await self._started
        self.counters["touches"] += 1
        self.index.touch(keys)

    async def pin(self, batch: PinBatch) -> int:
        """Pin held keys for their TTLs, or extend their pins (a request with
        ``cache_ttl_s`` used them); how many files are pinned."""
        await self._started
        outcome = self.index.pin(batch)
        outcome.count_into(self.counters)
        return outcome.pinned

    async def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names (the files stay, under LRU); how many went."""
        await self._started
        n = self.index.unpin(which)
        self.counters["unpinned"] += n
        return n

    @runs_to_end
    async def remove(self, keys: Sequence[bytes], reason: str = "removed", details: Sequence[str] = ()) -> int:
        """Forget keys (corrupt or missing files): unregister and delete them.

        For ``reason="missing"`` the files are looked up here first and keys
        whose file this actor does see are kept: one engine's view of shared
        storage can lag (NFS caches negative lookups), and a second opinion
        costs a stat. Each file this removes from the index is counted
        (``raykv_tier_removed_files``) and logged with its key, path and
        ``details`` (what the engine found wrong, per key).
        """
        await self._started
        why = dict(zip(keys, details))
        keys = list(dict.fromkeys(keys))
        if reason == "missing":
            gone = await self._missing(keys)
            keys = [k for k in keys if k in gone]
        dropped = self._dropped(keys)
        self.removals.note(
            reason, [Removal(k.hex(), self.storage.path_of(k), str(why.get(k, ""))[:200]) for k in dropped]
        )
        self.counters["removed"] += len(dropped)
        self.removed_reasons[reason] += len(keys)
        await self._unregister(keys)
        if reason != "missing":
            await self._delete_files(keys)
        self._publish()
        return len(dropped)

    async def set_capacity(self, capacity_bytes: int) -> list[bytes]:
        """Run with another capacity from now on; returns the keys evicted to fit it."""
        await self._started
        evicted = self._evicted(self.index.set_capacity(capacity_bytes))
        if evicted:
            await self._unregister(evicted)
            await self._delete_files(evicted)
        self._publish()
        return evicted

    async def drop_identities(self, tags: Sequence[bytes]) -> int:
        """Forget and delete every block whose key starts with one of ``tags``
        (``raykv invalidate``); returns how many went."""
        await self._started
        dropped = self._dropped(self.index.with_prefix(tags))
        self.counters["invalidated"] += len(dropped)
        self.removed_reasons["invalidated"] += len(dropped)
        await self._unregister(dropped)
        await self._delete_files(dropped)
        self._publish()
        return len(dropped)

    def pin_table(self) -> TenantLRU:
        return self.index.tenants

    def tier_stats(self) -> Report:
        index = self.index
        return {
            "root": self.root,
            "files": len(index),
            "bytes": index.bytes,
            "capacity_bytes": index.capacity,
            "tenant_bytes": dict(index.tenants.bytes_by_tenant()),
            "tenant_quotas": dict(index.tenants.quotas),
            "scanned_at_start": self.scanned,
            "removed_reasons": dict(self.removed_reasons),
            "removed_files_logged": dict(self.removals.totals),
            **index.tenants.pin_report(),
            **self.counters,
        }
