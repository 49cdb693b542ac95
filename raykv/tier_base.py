"""Shared engine-side machinery of directory-backed tiers (object_store, fs)."""

from __future__ import annotations

import asyncio
import time
from abc import abstractmethod
from collections.abc import Collection, Iterable
from typing import Any

from raykv.cluster import RaykvServices, attach
from raykv.contract import (
    JobResult,
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTier,
)
from raykv.directory.holders import HolderInfo
from raykv.jobs import JobTracker
from raykv.keys import OffloadKey


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
    ) -> None:
        super().__init__(primary_kv_view, tier_type)
        self.services = services or attach(namespace, start_if_missing=True)
        self.node_id = self.services.node_id()
        self.jobs = JobTracker()
        self._cache = self.services.lookup_cache

    @abstractmethod
    def serves(self, holders: list[HolderInfo]) -> bool:
        """Whether this tier should load a key held by ``holders``."""

    @abstractmethod
    def poll_jobs(self) -> None:
        """Move completed transfers into ``self.jobs`` without blocking."""

    # -- contract ------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._cache.poll()
        holders = self._cache.get(key)
        if holders is None:
            self._cache.request(key)
            return LookupResult.RETRY
        return LookupResult.HIT if self.serves(holders) else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.services.policy.decide(self.tier_type, req_context)

    def on_schedule_end(self) -> None:
        self._cache.flush()

    def has_pending_work(self) -> bool:
        return self.jobs.num_pending > 0 or self._cache.has_pending()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self.poll_jobs()
        return self.jobs.take()

    def drain_jobs(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.jobs.num_pending and time.monotonic() < deadline:
            self.poll_jobs()
            if self.jobs.num_pending:
                self.jobs.wait_idle(0.005)
        for job in self.jobs.pending():  # never leave a job without a result
            self.jobs.fail(job, f"not finished within drain timeout of {timeout}s")

    def lookup_blocking(self, keys: Collection[OffloadKey], timeout: float = 10.0) -> list[LookupResult]:
        """Resolve ``keys`` now (tools and tests; engines use ``lookup``)."""
        for k in keys:
            if self._cache.get(k) is None:
                self._cache.request(k)
        self._cache.wait(timeout)
        ctx = ReqContext("lookup_blocking")
        return [self.lookup(k, ctx) for k in keys]


class WatchableActor:
    """Mixin for holder actors: the directory watches them with ``raykv_watch``."""

    async def raykv_watch(self) -> None:
        """Never returns; the caller learns of this actor's death when it errors."""
        await asyncio.Event().wait()

    async def raykv_ping(self) -> Any:
        return True
