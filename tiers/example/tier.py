"""``ExampleTier``: a process-local in-memory tier.

It shows the whole contract in little code: submits hand the copy to a worker
thread and return at once; every job ends in exactly one ``JobResult``; loads
of keys it does not hold fail (with ``successful_keys`` for the others);
capacity is a block count with LRU eviction (``raykv.core.tenants.TenantLRU``),
where a request's ``cache_ttl_s`` pins its blocks (``raykv.core.pins``). It
talks to no directory, so it only serves the process that stored the blocks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np

from raykv.core.contract import (
    JobResult,
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTier,
    TransferJob,
)
from raykv.core.fields import opt
from raykv.core.identity import KVIdentity
from raykv.core.jobs import JobTracker
from raykv.core.keys import OffloadKey
from raykv.core.pins import Unpin, cache_ttl_of, max_pinned_fraction_option, pin_keys
from raykv.core.tenants import TenantLRU, tenant_of
from raykv.policy import PolicyRule, decide


@dataclass
class ExampleOptions:
    capacity_blocks: int = opt(1024, kind=int, min=0, doc="blocks kept (LRU); 0 = none")
    max_pinned_fraction: float = max_pinned_fraction_option()
    request_level: bool = opt(False, kind=bool, doc="ask for REQUEST_LEVEL for every request")


class ExampleTier(SecondaryTier):
    """Blocks live in a dict of numpy arrays in this process."""

    Options = ExampleOptions
    medium = "plasma"

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        options: ExampleOptions,
        identity: KVIdentity | None = None,
        **_: object,
    ) -> None:
        super().__init__(primary_kv_view, tier_type, identity)
        self.options = options
        self._primary = np.asarray(primary_kv_view)
        self._blocks: dict[bytes, np.ndarray] = {}  # scoped key -> block
        #: LRU order and pins; each block counts 1 (the capacity is in blocks).
        self.lru = TenantLRU(max_pinned_fraction=options.max_pinned_fraction)
        self._lock = threading.Lock()
        self.jobs = JobTracker()
        self._rules = [PolicyRule(tier=tier_type)] if options.request_level else []
        self._work: queue.SimpleQueue[tuple[str, TransferJob] | None] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="raykv-example-tier", daemon=True)
        self._worker.start()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            return LookupResult.HIT if self.scope(bytes(key), req_context) in self._blocks else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self._submit("store", job)

    def submit_load(self, job: TransferJob) -> None:
        self._submit("load", job)

    def _submit(self, kind: str, job: TransferJob) -> None:
        self.jobs.begin(job)
        if self._closed:
            self.jobs.fail(job, "tier is shut down")
        else:
            self._work.put((kind, job))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return self.jobs.take()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return decide(self._rules, self.tier_type, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        ttl = cache_ttl_of(req_context)
        with self._lock:
            scope = self.key_scope(req_context)
            scoped = [self.scope(bytes(key), scope=scope) for key in keys]
            self.lru.touch(scoped)
            if ttl is not None:
                self.lru.pin(pin_keys(scoped), ttl, self.options.capacity_blocks)

    def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names; the blocks age under LRU again."""
        with self._lock:
            return self.lru.unpin(which)

    def drain_jobs(self) -> None:
        self.jobs.wait_idle()

    def shutdown(self) -> None:
        self._closed = True
        self._work.put(None)
        self._worker.join(timeout=5)
        for job in self.jobs.pending():
            self.jobs.fail(job, "tier shut down")

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            kind, job = item
            try:
                (self._store if kind == "store" else self._load)(job)
            except Exception as e:  # a job must end in a result, whatever happens
                self.jobs.fail(job, repr(e))

    def _store(self, job: TransferJob) -> None:
        cap = self.options.capacity_blocks
        tenant, ttl = tenant_of(job.req_context), cache_ttl_of(job.req_context)
        with self._lock:
            scope = self.key_scope(job.req_context)
            keys = [self.scope(bytes(k), scope=scope) for k in job.keys]
            for key, chunk in zip(keys, job.chunk_ids):
                if key not in self._blocks:
                    self._blocks[key] = self._primary[chunk].copy()
                self.lru.add(key, tenant, 1)
            # Pinned blocks are never victims: with only they left, the new ones go.
            while len(self._blocks) > cap and (victim := self.lru.oldest()) is not None:
                del self._blocks[victim]
                self.lru.discard(victim)
            if ttl is not None:
                self.lru.pin(pin_keys(keys), ttl, cap)
        self.jobs.succeed(job, transfer_bytes=len(job.keys) * self.block_size_bytes)

    def _load(self, job: TransferJob) -> None:
        loaded: list[OffloadKey] = []
        scope = self.key_scope(job.req_context)
        with self._lock:
            for key, chunk in zip(job.keys, job.chunk_ids):
                block = self._blocks.get(self.scope(bytes(key), scope=scope))
                if block is not None:
                    self._primary[chunk] = block
                    loaded.append(key)
        if len(loaded) == len(job.keys):
            self.jobs.succeed(job, transfer_bytes=len(loaded) * self.block_size_bytes)
        else:
            self.jobs.fail(job, "some keys are not held", successful_keys=loaded)
