"""``FsRootActor``: the owner of one shared-storage root.

One detached actor per root (named ``naming.fs_actor(root)``) keeps the index
of block files (key -> file size, in LRU order) and the root's byte capacity.
Engines write block files themselves (no bytes pass through this actor) and
then ``commit`` the keys in one call per job batch; the actor registers them
at the directory, evicts least-recently-used files to stay within capacity
(deleting the files and unregistering the keys) and answers which keys did
not stay. It is the directory's holder for the root (medium SHARED), so when
it dies the directory drops every key of the root at once; when it (re)starts
it scans the root and registers what is there, so a restart loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ray

from raykv.core import naming
from raykv.core.placement import SHARED, HolderInfo
from raykv.core.tenants import DEFAULT_TENANT, TenantLRU, fmt_tenants
from raykv.core.units import fmt_bytes
from raykv.holders.holder_actor import HolderActor, runs_to_end
from raykv.metrics.incidents import Removal, RemovalLog
from tiers.fs.storage import open_storage

logger = logging.getLogger(__name__)

REGISTER_BATCH = 20_000


def holder_info(root: str, namespace: str) -> HolderInfo:
    """The directory holder of a (canonical) root."""
    return HolderInfo(f"fs:{naming.root_digest(root)}", "fs", SHARED, naming.fs_actor(root), namespace, None)


#: The actor's counters exported as raykv's tier metrics (tier fs, node "shared").
METRIC_COUNTERS = {
    "committed": "raykv_tier_stored_blocks",
    "evicted": "raykv_tier_evicted_blocks",
    "removed": "raykv_tier_removed_blocks",
}


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=10_000)
class FsRootActor(HolderActor):
    """Index, capacity and directory registration of one root's block files."""

    #: Block files outlive the actor: a restart scans and re-registers them.
    BLOCKS_DIE_WITH_ACTOR = False

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        namespace: str,
        tmp_max_age_s: float = 3600.0,
        tenant_quotas: dict[str, int] | None = None,
    ) -> None:
        super().__init__(holder_info(root, namespace), namespace, METRIC_COUNTERS)
        self.root = root
        self.capacity = int(capacity_bytes)  # 0: unlimited
        self.requested_capacity = self.capacity
        # Bytes per tenant, each tenant's LRU, quotas. Files carry no tenant: after a
        # restart the scanned files belong to the default tenant.
        self._tenants = TenantLRU(tenant_quotas)
        self.storage = open_storage(root)
        self.storage.ensure_root()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self.counters.update(
            dict.fromkeys(
                ("commits", "committed", "evicted", "removed", "invalidated", "touches", "directory_errors"), 0
            )
        )
        self.removed_reasons: dict[str, int] = {}
        #: Every removed file counted (by reason) and logged with its key and path.
        self.removals = RemovalLog(f"fs root {root}", self._metrics.tags)
        self.scanned = 0
        self._tmp_max_age_s = tmp_max_age_s

    async def recover(self) -> None:
        """Scan the root and register every block file found (oldest first in LRU)."""
        t0 = time.monotonic()
        entries = await asyncio.to_thread(self.storage.scan, self._tmp_max_age_s)
        for reason, found in self.storage.scan_removals().items():
            self.removed_reasons[reason] = self.removed_reasons.get(reason, 0) + len(found)
            self.removals.note(reason, found)
        for e in sorted(entries, key=lambda e: e.mtime):  # oldest first: mtime stands in for last use
            if e.key not in self._index:
                self._index[e.key] = e.size
                self._bytes += e.size
                self._tenants.add(e.key, DEFAULT_TENANT, e.size)
        evicted = self._evict()
        if evicted:
            await asyncio.to_thread(self.storage.delete, evicted)
        keys = list(self._index)
        for i in range(0, len(keys), REGISTER_BATCH):
            await self._register(keys[i : i + REGISTER_BATCH])
        self.scanned = len(entries)
        logger.info(
            "fs root %s: found %d block files (%s) in %.2fs, evicted %d over capacity",
            self.root,
            len(entries),
            fmt_bytes(self._bytes),
            time.monotonic() - t0,
            len(evicted),
        )

    def __repr__(self) -> str:
        # What and where only: the dashboard records a repr once, at start (live
        # figures: `raykv status`, metrics). Must work when __init__ raised early.
        d = self.__dict__
        cap = d.get("capacity")
        cap_text = "?" if cap is None else fmt_bytes(cap) if cap else "unlimited"
        return f"FsRoot({d.get('root', '?')}, capacity {cap_text})"

    def status_line(self) -> str:
        c = self.counters
        cap = f"{fmt_bytes(self.capacity)} ({100 * self._bytes / self.capacity:.0f}%)" if self.capacity else "unlimited"
        return (
            f"fs root={self.root}: {len(self._index)} files, {fmt_bytes(self._bytes)} / {cap}; "
            f"committed {c['committed']}, evicted {c['evicted']}, removed {c['removed']}, touches {c['touches']}"
            f"{fmt_tenants(self._tenants.bytes_by_tenant())}"
        )

    def held_keys(self) -> list[bytes]:
        return list(self._index)

    def occupancy(self) -> tuple[int, int, int]:
        return len(self._index), self._bytes, self.capacity

    def describe(self) -> dict[str, Any]:
        return {"root": self.root, "capacity_bytes": self.capacity, "requested_capacity_bytes": self.requested_capacity}

    # -- helpers -----------------------------------------------------------

    def _evict(self, tenants: Sequence[str] = ()) -> list[bytes]:
        """Evict to stay within capacity (and, for ``tenants`` committing now,
        their quotas; ``raykv.core.tenants``). With quotas, another tenant's files
        within its quota go only when no committing tenant is named (a restart's
        scan, a smaller capacity)."""
        out: list[bytes] = []
        quotas = bool(self._tenants.quotas)
        for t in dict.fromkeys(tenants) if quotas else ():
            while (victim := self._tenants.own_victim(t, 0)) is not None:
                self._pop(victim, out)
        while 0 < self.capacity < self._bytes and self._index:
            victim = self._tenants.shared_victim(None) if quotas else None
            if victim is None and quotas:
                victim = next((v for t in dict.fromkeys(tenants) if (v := self._tenants.shared_victim(t))), None)
            self._pop(victim if victim is not None else next(iter(self._index)), out)
        self.counters["evicted"] += len(out)
        self.log.append(True, out)
        return out

    def _pop(self, key: bytes, out: list[bytes]) -> None:
        self._bytes -= self._index.pop(key)
        self._tenants.discard(key)
        out.append(key)

    def _drop(self, keys: Sequence[bytes]) -> list[bytes]:
        dropped = []
        for k in keys:
            size = self._index.pop(k, None)
            if size is not None:
                self._bytes -= size
                self._tenants.discard(k)
                dropped.append(k)
        self.log.append(True, dropped)
        return dropped

    async def _delete_files(self, keys: list[bytes]) -> None:
        # A key may be back (re-committed while we awaited): keep its file.
        keys = [k for k in keys if k not in self._index]
        if keys:
            await asyncio.to_thread(self.storage.delete, keys)

    # -- API -----------------------------------------------------------------
    @runs_to_end
    async def commit(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        verify: Sequence[bytes] = (),
        tenants: Sequence[str] | None = None,
    ) -> dict[str, list[bytes]]:
        """Take ``keys`` (files written, or found present, by an engine) into the index.

        ``verify``: keys the engine did not write because their file existed;
        those the index does not know are checked on disk first (the file may
        have been evicted in between) and reported as ``missing`` if gone.
        Returns ``{"evicted": [...], "missing": [...]}``; ``evicted`` may hold
        keys of this batch when the batch alone exceeds the capacity.
        """
        await self._started
        self.counters["commits"] += 1
        check = [k for k in verify if k not in self._index]
        missing: set[bytes] = set()
        if check:
            sizes_now = await asyncio.to_thread(lambda: [self.storage.existing_size(k) for k in check])
            missing = {k for k, s in zip(check, sizes_now) if s is None}
        # From here to the first await the index and the directory calls change together.
        held = []
        new = []
        owners = list(tenants) if tenants is not None else [DEFAULT_TENANT] * len(keys)
        for k, size, tenant in zip(keys, sizes, owners):
            if k in missing:
                continue
            self._tenants.add(k, tenant, size)  # a held key keeps its first tenant
            old = self._index.get(k)
            if old is None:
                self._bytes += size
                self._index[k] = size
                self.counters["committed"] += 1
                new.append(k)
            else:
                self._bytes += size - old
                self._index[k] = size
                self._index.move_to_end(k)
            held.append(k)
        evicted = self._evict(owners)
        gone = set(evicted)
        self.log.append(False, [k for k in new if k not in gone])
        await asyncio.gather(self._register([k for k in held if k not in gone]), self._unregister(evicted))
        if evicted:  # after the directory stopped pointing at them
            await self._delete_files(evicted)
        self._publish()
        return {"evicted": evicted, "missing": list(missing)}

    async def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys recently used (LRU)."""
        await self._started
        self.counters["touches"] += 1
        for k in keys:
            if k in self._index:
                self._index.move_to_end(k)
        self._tenants.touch(keys)

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
            sizes = await asyncio.to_thread(lambda: [self.storage.existing_size(k) for k in keys])
            keys = [k for k, size in zip(keys, sizes) if size is None]
        dropped = self._drop(keys)
        self.removals.note(
            reason, [Removal(k.hex(), self.storage.path_of(k), str(why.get(k, ""))[:200]) for k in dropped]
        )
        self.counters["removed"] += len(dropped)
        self.removed_reasons[reason] = self.removed_reasons.get(reason, 0) + len(keys)
        await self._unregister(keys)
        if reason != "missing":
            await self._delete_files(keys)
        self._publish()
        return len(dropped)

    async def set_capacity(self, capacity_bytes: int) -> list[bytes]:
        await self._started
        self.capacity = int(capacity_bytes)
        evicted = self._evict()
        if evicted:
            await self._unregister(evicted)
            await self._delete_files(evicted)
        self._publish()
        return evicted

    async def drop_identities(self, tags: Sequence[bytes]) -> int:
        """Forget and delete every block whose key starts with one of ``tags``
        (``raykv invalidate``); returns how many went."""
        await self._started
        prefixes = tuple(tags)
        keys = [k for k in self._index if k.startswith(prefixes)]
        dropped = self._drop(keys)
        self.counters["invalidated"] += len(dropped)
        self.removed_reasons["invalidated"] = self.removed_reasons.get("invalidated", 0) + len(dropped)
        await self._unregister(dropped)
        await self._delete_files(dropped)
        self._publish()
        return len(dropped)

    def tier_stats(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "files": len(self._index),
            "bytes": self._bytes,
            "capacity_bytes": self.capacity,
            "tenant_bytes": self._tenants.bytes_by_tenant(),
            "tenant_quotas": dict(self._tenants.quotas),
            "scanned_at_start": self.scanned,
            "removed_reasons": dict(self.removed_reasons),
            "removed_files_logged": dict(self.removals.totals),
            **self.counters,
        }
