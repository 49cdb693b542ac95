"""Shared engine-side machinery of directory-backed tiers (object_store, fs)."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
import ray

from raykv.cluster import RaykvServices, attach
from raykv.contract import (
    JobResult,
    TierEvent,
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTier,
    TransferJob,
)
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.holders import HolderInfo
from raykv.identity import KVIdentity
from raykv.jobs import JobTracker
from raykv.metrics import MeteredJobTracker, TierMetrics
from raykv.keys import GROUP_IDX_BYTES, MAX_KEY_BYTES, OffloadKey, shard_of, validate_key

logger = logging.getLogger(__name__)


class DirectoryBackedTier(SecondaryTier):
    """A tier whose blocks are found through the cluster directory.

    ``lookup`` answers from the process's ``LookupCache``: unknown keys return
    RETRY and are resolved in one batched directory call at the end of the
    step (``on_schedule_end``). Subclasses say which holders they can load
    from (``serves``) and implement the data path.
    """

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        namespace: str,
        services: RaykvServices | None = None,
        identity: KVIdentity | None = None,
    ) -> None:
        super().__init__(primary_kv_view, tier_type, identity)
        self.services = services or attach(namespace, start_if_missing=True)
        self.node_id = self.services.node_id()
        self.metrics = TierMetrics(tier_type, self.node_id)
        self.jobs: JobTracker = MeteredJobTracker(self.metrics, self.block_size_bytes)
        self._cache = self.services.lookup_cache
        self.services.register_identity(self.identity)
        self._events: HoldingsFeed | None = None

    # -- KV events -----------------------------------------------------------
    #: The holder actor whose holdings this tier reports (set by subclasses).
    actor: Any = None

    def enable_events(self) -> None:
        """Report this identity's blocks in the holder actor as ``TierEvent``s
        (``take_events``): a snapshot first, then stores and removals."""
        if self._events is None and self.actor is not None:
            self._events = HoldingsFeed(self.actor, self.key_tag)

    def take_events(self) -> list[TierEvent]:
        if self._events is None:
            return []
        self._events.poll()
        return self._events.take()

    @abstractmethod
    def serves(self, holders: list[HolderInfo]) -> bool:
        """Whether this tier should load a key held by ``holders``."""

    @abstractmethod
    def poll_jobs(self) -> None:
        """Move completed transfers into ``self.jobs`` without blocking."""

    # -- contract ------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if type(key) is not bytes:
            try:
                key = validate_key(key)
            except ValueError:
                return LookupResult.MISS  # a malformed key is nobody's: never batch it
        elif not GROUP_IDX_BYTES < len(key) <= MAX_KEY_BYTES:
            return LookupResult.MISS
        return self._lookup_scoped(self.key_tag + key, req_context)

    def _lookup_scoped(self, key: bytes, req_context: ReqContext | None = None) -> LookupResult:
        self._cache.poll()
        holders = self._cache.get(key)
        if holders is None and req_context is not None and self._resolve_prefix(key, req_context):
            holders = self._cache.get(key)
        if holders is None:
            self._cache.request(key)
            self.metrics.lookup(LookupResult.RETRY)
            return LookupResult.RETRY
        result = LookupResult.HIT if self.serves(holders) else LookupResult.MISS
        self.metrics.lookup(result)  # a local count; flushed to Ray once per step
        return result

    def _resolve_prefix(self, key: bytes, req_context: ReqContext) -> bool:
        """At a request's first unknown key: look up its whole prefix (or this
        key) in one directory call and wait up to ``lookup_wait_ms`` for it, so
        that HIT and MISS are answered in the step that asked."""
        wait_s = getattr(self.services.config, "lookup_wait_ms", 0.0) / 1000
        if wait_s <= 0 or req_context.prefix_resolved:
            return False
        req_context.prefix_resolved = True
        keys = [key]
        if req_context.prefix_keys is not None:
            tag = self.key_tag
            try:
                keys += [
                    tag + k for k in req_context.prefix_keys()
                    if type(k) is bytes and GROUP_IDX_BYTES < len(k) <= MAX_KEY_BYTES
                ]
            except Exception as e:  # the engine's bookkeeping: never fail a lookup over it
                logger.debug("prefix keys unavailable: %r", e)
        return self._cache.resolve(keys, wait_s)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.services.policy.decide(self.tier_type, req_context)

    def on_schedule_end(self) -> None:
        self._cache.flush()
        self.metrics.flush()
        if self._events is not None:
            self._events.poll()

    def has_pending_work(self) -> bool:
        return self.jobs.num_pending > 0 or self._cache.has_pending()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self.poll_jobs()
        results = self.jobs.take()
        if results:
            self.metrics.flush()
        return results

    def drain_jobs(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.jobs.num_pending and time.monotonic() < deadline:
            self.poll_jobs()
            if self.jobs.num_pending:
                self.jobs.wait_idle(0.005)
        for job in self.jobs.pending():  # never leave a job without a result
            self.jobs.fail(job, f"not finished within drain timeout of {timeout}s")

    def job_slots(self, job: TransferJob) -> tuple[list[bytes], list[int]]:
        """A submitted job's validated, identity-scoped keys and its chunk ids
        (``ValueError`` when malformed). Results name the job's own keys."""
        tag = self.key_tag
        keys = [tag + validate_key(k) for k in job.keys]
        ids = np.asarray(job.chunk_ids)
        if ids.size and ids.dtype.kind not in "iu":  # never turn 2.7 or "3" into a slot
            raise ValueError(f"chunk ids must be ints, got {ids.dtype} values")
        chunks = [int(c) for c in ids.reshape(-1)]
        if len(keys) != len(chunks):
            raise ValueError(f"{len(keys)} keys but {len(chunks)} chunk ids")
        return keys, chunks

    def lookup_blocking(self, keys: Collection[OffloadKey], timeout: float = 10.0) -> list[LookupResult]:
        """Resolve ``keys`` now (tools and tests; engines use ``lookup``)."""
        scoped = [self.key_tag + validate_key(k) for k in keys]
        for k in scoped:
            if self._cache.get(k) is None:
                self._cache.request(k)
        self._cache.wait(timeout)
        return [self._lookup_scoped(k) for k in scoped]


async def settle(refs: Iterable[Any], what: str = "directory call") -> int:
    """Await actor calls (a holder's directory updates); log failures, count them.

    A directory shard that dies mid-call restarts and rebuilds its entries
    from the holders (``raykv_resync``), so a failed update is not lost and
    must not fail the holder's own operation.
    """
    failed = 0
    for r in await asyncio.gather(*refs, return_exceptions=True):
        if isinstance(r, BaseException):
            failed += 1
            logger.warning("%s failed (the shard rebuilds from holders): %r", what, r)
    return failed


class HoldingsFeed:
    """Reads a holder actor's ``HoldingsLog`` for one identity, one call in
    flight at a time, never blocking; results wait in ``take``."""

    #: Events kept for a caller that does not take them; past this, the
    #: oldest go and the next read is a fresh snapshot.
    MAX_KEYS = 1 << 18

    def __init__(self, actor: Any, tag: bytes) -> None:
        self.actor = actor
        self.tag = tag
        self._since: int | None = None  # None: ask for a snapshot
        self._call: Any = None
        self._pending: list[TierEvent] = []
        self._keys = 0
        self._strip = len(tag)

    def poll(self) -> None:
        if self._call is not None:
            ready, _ = ray.wait([self._call], timeout=0)
            if not ready:
                return
            call, self._call = self._call, None
            try:
                out = ray.get(call, timeout=0)
            except Exception as e:  # the actor died or restarted: start over with a snapshot
                logger.debug("holdings feed: %r", e)
                self._since = None
                return
            self._absorb(out)
        try:
            self._call = self.actor.events_since.remote(self._since, self.tag)
        except Exception as e:
            logger.debug("holdings feed not sent: %r", e)

    def _absorb(self, out: dict[str, Any]) -> None:
        n = self._strip
        if out["snapshot"] is not None:
            self._pending.append(TierEvent([k[n:] for k in out["snapshot"]], removed=False))
            self._keys += len(out["snapshot"])
        for removed, keys in out["events"]:
            self._pending.append(TierEvent([k[n:] for k in keys], removed=removed))
            self._keys += len(keys)
        self._since = out["next"]
        while self._keys > self.MAX_KEYS and self._pending:  # nobody takes them
            self._keys -= len(self._pending.pop(0).keys)
            self._since = None

    def take(self) -> list[TierEvent]:
        out, self._pending, self._keys = self._pending, [], 0
        return out


class ActorLiveness:
    """An engine-side view of a ``WatchableActor``'s life, polled without blocking.

    A never-returning ``raykv_watch`` call errors when the actor dies; while it
    is dead, a ``raykv_ping`` once per ``ping_period_s`` notices Ray restarting
    it (``max_restarts``), and a new watch starts.
    """

    def __init__(self, actor: Any, what: str, ping_period_s: float = 1.0) -> None:
        self.actor = actor
        self.what = what  # for logs: "object store actor of node ..."
        self.ping_period_s = ping_period_s
        self.alive = True
        self._watch = actor.raykv_watch.remote()
        self._ping: Any = None
        self._next_ping = 0.0

    def mark_dead(self, reason: str) -> None:
        """Record a death seen elsewhere (e.g. a call that raised ``RayActorError``)."""
        if self.alive:
            logger.warning("%s is gone (%s)", self.what, reason)
        self.alive = False

    def poll(self) -> None:
        """Update ``alive`` from the watch and, while dead, the pings."""
        if self.alive:
            ready, _ = ray.wait([self._watch], timeout=0)
            if ready:
                self.mark_dead("watch ended")
            return
        if self._ping is not None:
            ready, _ = ray.wait([self._ping], timeout=0)
            if not ready:
                return
            ping, self._ping = self._ping, None
            try:
                ray.get(ping, timeout=0)
            except Exception:
                return
            self.alive = True  # restarted: it rebuilt its state and re-registered
            self.close()  # in case it was only unreachable and the old watch lives
            self._watch = self.actor.raykv_watch.remote()
            logger.info("%s is back", self.what)
        elif time.monotonic() >= self._next_ping:
            self._next_ping = time.monotonic() + self.ping_period_s
            try:
                self._ping = self.actor.raykv_ping.remote()
            except Exception:
                self._ping = None

    def close(self) -> None:
        """Cancel the watch call (it would otherwise hold an actor slot forever)."""
        try:
            ray.cancel(self._watch)
        except Exception:
            pass


class WatchableActor:
    """Mixin for holder actors: the directory watches them with ``raykv_watch``."""

    async def raykv_watch(self) -> None:
        """Never returns; the caller learns of this actor's death when it errors."""
        await asyncio.Event().wait()

    async def raykv_ping(self) -> Any:
        return True

    def raykv_holdings(self) -> tuple[Any, list[bytes]]:
        """This holder's ``HolderInfo`` and every key it holds now (override).

        Must answer at once, even while the actor is still starting: a
        restarting directory shard calls it (``raykv_resync``) and the actor's
        own start-up may be waiting on that shard.
        """
        raise NotImplementedError

    async def raykv_resync(self, shard: int, num_shards: int) -> tuple[dict[str, Any], list[bytes]]:
        """For a (re)started directory shard: our holder info and our keys of that shard."""
        info, keys = self.raykv_holdings()
        return info.to_dict(), _keys_of_shard(keys, shard, num_shards)

    def start_reconciling(self, directory: Any, period_s: float) -> "asyncio.Task | None":
        """Repair drift between this holder and the directory every ``period_s``.

        The directory learns a holder's keys from its register / unregister
        calls, a rebuild and a watch. Each can be lost without the holder
        dying (a call failed while a shard restarted, a rebuild timed out, a
        watch errored under load); the entries then stay wrong until the holder
        restarts. So the holder compares its own key count per shard with the
        shard's, and a shard that differs twice in a row (a single difference
        may be calls in flight) gets the holder's full listing (``sync_holder``).
        """
        if period_s <= 0:
            return None
        return asyncio.get_running_loop().create_task(self._reconcile(directory, period_s))

    async def _reconcile(self, directory: Any, period_s: float) -> None:
        me = ray.get_runtime_context().current_actor
        suspect: set[int] = set()
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._reconcile_once(directory, me, suspect)
            except Exception as e:  # best effort: try again next period
                logger.debug("directory reconcile failed: %r", e)

    async def _reconcile_once(self, directory: Any, me: Any, suspect: set[int]) -> int:
        """One round; returns how many shards were sent a full listing."""
        n = directory.num_shards
        info, keys = self.raykv_holdings()
        mine = _per_shard_counts(keys, n)
        counts = await asyncio.gather(
            *(s.holder_counts.remote(info.holder_id) for s in directory.shards), return_exceptions=True
        )
        repaired = 0
        for i, listed in enumerate(counts):
            if isinstance(listed, BaseException):
                continue  # a restarting shard rebuilds from us anyway
            if listed == mine[i]:
                suspect.discard(i)
                continue
            if i not in suspect:
                suspect.add(i)
                continue
            # Snapshot and send with no await in between: later register /
            # unregister calls of ours reach the shard after this listing.
            info, keys = self.raykv_holdings()
            part = _keys_of_shard(keys, i, n)
            ref = directory.shards[i].sync_holder.remote(info.to_dict(), me, to_blob(fingerprints(part)))
            suspect.discard(i)
            await ref
            repaired += 1
        return repaired


def _keys_of_shard(keys: list[bytes], shard: int, num_shards: int) -> list[bytes]:
    """The ones of ``keys`` that directory shard ``shard`` owns."""
    return [k for k in keys if shard_of(k, num_shards) == shard]


def _per_shard_counts(keys: list[bytes], num_shards: int) -> list[int]:
    """How many of ``keys`` each directory shard owns."""
    from raykv.directory.client import shard_ids

    ids = shard_ids(keys, num_shards) if keys else None
    if ids is None:
        ids = [shard_of(k, num_shards) for k in keys]
    return np.bincount(np.asarray(ids, dtype=np.int64), minlength=num_shards).tolist()
