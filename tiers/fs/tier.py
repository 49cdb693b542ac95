"""``FsTier``: the engine-side client of a shared-storage root.

Runs in the engine's scheduler process. Block bytes go between the primary
region and block files (``storage``) on an I/O thread pool where loads are
served ahead of stores (``io_pool``), through a staging buffer per thread, so
that a job can fail at its deadline whatever its storage does (``deadlines``); only keys and sizes go to the root's
actor (``actor.FsRootActor``), in one call per batch from a control thread (``control.RootController``):

- store job: write every missing block file (atomic, checksummed, optionally
  fsync'ed) -> one batched ``commit`` to the root actor (which registers the
  keys at the directory and evicts LRU files over capacity) -> JobResult.
- load job: read + verify each block into its primary slot -> JobResult
  (``successful_keys`` when some failed). Corrupt/truncated or missing files
  are ``remove``d via the actor (file deleted, directory updated) before the
  failure is reported, so the next lookup already misses.

Nothing here blocks the scheduler thread, and every job ends in exactly one
JobResult: I/O errors, a dead root actor, timeouts (``job_timeout_s``: storage
that does not answer) and shutdown all become failed results.
"""

from __future__ import annotations

import errno
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np
import ray

from raykv.core.contract import ReqContext, TransferJob
from raykv.core.fields import bytes_option, namespace_option, opt
from raykv.core.handles import HolderHandle
from raykv.core.identity import KVIdentity
from raykv.core.keys import OffloadKey
from raykv.core.pins import Unpin, cache_ttl_of, max_pinned_fraction_option
from raykv.core.placement import SHARED, HolderInfo
from raykv.core.tenants import tenant_quotas_option
from raykv.core.validate import ConfigError
from raykv.engine.actor_tier import DirectoryBackedTier
from raykv.holders.messages import HolderStats
from raykv.metrics.incidents import Removal, RemovalLog
from raykv.services.cluster import RaykvServices
from tiers.fs import format as fmt
from tiers.fs import io_pool
from tiers.fs.actor import holder_info, start_root_actor
from tiers.fs.control import CallFailed, RootController
from tiers.fs.deadlines import Deadlines
from tiers.fs.format import FormatError
from tiers.fs.jobs import CORRUPT, ERROR, EXISTING, MISSING, OK, WRITTEN, BlockJob, Outcome
from tiers.fs.messages import DEFAULT_CAPACITY_BYTES, CommitReport, FsRootSettings
from tiers.fs.storage import Storage, canonical_root, check_root, open_storage, root_problem_here


@dataclass
class FsOptions:
    root: str = opt(
        kind=str,
        check=check_root,
        doc="shared storage root: an absolute path (NFS/Lustre/EFS mount) or a pyarrow.fs URI (s3://bucket/prefix)",
    )
    namespace: str = namespace_option()
    capacity_bytes: int = bytes_option(
        DEFAULT_CAPACITY_BYTES,
        min=0,
        doc="bytes of block files kept under the root (LRU eviction, file sizes incl. headers); 0 = unlimited",
    )
    io_threads: int = opt(
        4, kind=int, min=1, max=1024, warn_above=64, doc="I/O threads of this engine (loads go before stores)"
    )
    fsync: bool = opt(True, kind=bool, doc="fsync each block file and its directory before a store counts as done")
    checksum: str = opt(
        "auto",
        kind=str,
        check=fmt.check_algorithm,
        doc="checksum of written blocks: auto (fastest installed: xxh3 > crc32c > blake3 > crc32), "
        "xxh3 (pip xxhash), crc32c (pip crc32c), blake3, crc32 (stdlib); loads verify whatever a file says",
    )
    control_timeout_s: float = opt(
        30.0, kind=float, min=0.1, max=86400.0, doc="longest wait for the root actor before a job fails"
    )
    job_timeout_s: float = opt(
        30.0,
        kind=float,
        min=0.1,
        max=86400.0,
        doc="longest a store or load job waits for the storage: past it the job fails, and while every "
        "I/O thread waits on such a job's call (a hung mount) the tier loads nothing and fails new jobs at once",
    )
    tenant_quotas: dict = tenant_quotas_option(
        "bytes of block files under the root", "Set when the root's actor starts"
    )
    max_pinned_fraction: float = max_pinned_fraction_option()

    def actor_settings(self) -> FsRootSettings:
        """What the root's actor runs with, when this engine starts it."""
        return FsRootSettings(
            canonical_root(self.root),
            self.capacity_bytes,
            dict(self.tenant_quotas),
            max_pinned_fraction=self.max_pinned_fraction,
        )


class FsTier(DirectoryBackedTier):
    """Blocks as checksummed files under a shared root, found via the directory."""

    Options = FsOptions
    medium = SHARED

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        options: FsOptions,
        services: RaykvServices | None = None,
        identity: KVIdentity | None = None,
        **_: object,
    ) -> None:
        super().__init__(primary_kv_view, tier_type, options.namespace, services, identity)
        self.options = options
        self.root = canonical_root(options.root)
        self.storage = open_storage(self.root, fmt.resolve_algorithm(options.checksum))
        self.holder_info: HolderInfo = holder_info(self.root, self.services.namespace)
        self.holder_id = self.holder_info.holder_id
        arr = np.asarray(primary_kv_view)
        if arr.dtype != np.uint8:
            arr = arr.view(np.uint8).reshape(arr.shape[0], -1)
        self._slots = arr
        self.actor = self.start_services(self.services, options)
        self._closed = False
        self._deadlines = Deadlines(
            options.job_timeout_s, f"root {self.root}", self._slots.shape[1], options.io_threads
        )
        self._pool = io_pool.IoPool(options.io_threads, name="raykv-fs-io")
        self._control = RootController(
            self.actor,
            self.holder_info.actor_name,
            self.services.namespace,
            options.control_timeout_s,
            on_committed=self._finish_store,
            on_removed=self._finish_load_failure,
            on_failed=self.jobs.fail,
        )
        self.liveness = self._control.liveness
        #: Files this engine removed itself (when the root actor could not), counted and logged.
        self.removals = RemovalLog(
            f"fs root {self.root} (engine side)", {**self.metrics.tags, "holder": self.holder_id}
        )

    # -- services ------------------------------------------------------------
    @classmethod
    def instance_key(cls, options: FsOptions) -> str:
        """One fs tier per root, however it is spelled (``raykv.core.factory.tier_instance_key``)."""
        return canonical_root(options.root)

    @classmethod
    def start_services(cls, services: RaykvServices, options: FsOptions) -> HolderHandle:
        """Start (or find) the root's ``FsRootActor``; returns its handle."""
        settings = options.actor_settings()
        problem = root_problem_here(settings.root)
        if problem:
            raise ConfigError("root", problem)
        actor = start_root_actor(settings, services.namespace)
        what = f"fs tier root {settings.root!r}: the root actor"
        cls.start_holder_actor(actor, what, settings.capacity_bytes, 300, settings)
        return actor

    # -- contract ------------------------------------------------------------
    def can_load(self, holder: HolderInfo) -> bool:
        return holder.holder_id == self.holder_id and self.holder_alive and not self._deadlines.stalled

    def poll_jobs(self) -> None:
        """End the jobs past their deadline (I/O threads and the control thread end the rest)."""
        for state, store in self._deadlines.overdue():
            (self._store_written if store else self._load_done)(state)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark keys used; a request with ``cache_ttl_s`` pins them (or extends their pins)."""
        if keys and not self._closed:
            scope = self.key_scope(req_context)
            scoped = [self.scope(bytes(k), scope=scope) for k in keys]
            ttl = cache_ttl_of(req_context)
            if ttl is None:
                self._control.touch(scoped)
            else:
                self._control.pin(scoped, ttl)

    def submit_store(self, job: TransferJob) -> None:
        self._submit(job, store=True)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(job, store=False)

    def _submit(self, job: TransferJob, store: bool) -> None:
        self.jobs.begin(job)
        try:
            keys, chunks = self.job_slots(job)
            if self._closed:
                raise RuntimeError("fs tier is shut down")
            self._deadlines.check()
            state = BlockJob(job, keys, chunks, self._deadlines.deadline())
            if not keys:
                self.jobs.succeed(job, transfer_bytes=0)
                return
            self._deadlines.add(state, store)
            run = self._store_one if store else self._load_one
            tasks = [(partial(run, state, i), partial(self._cancelled, state, i, store)) for i in range(len(keys))]
            self._pool.submit_many(io_pool.STORE if store else io_pool.LOAD, tasks)
        except Exception as e:
            self.jobs.fail(job, f"cannot submit: {e!r}")

    def _slot(self, chunk: int) -> np.ndarray:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk id {chunk} out of range [0, {self.num_chunks})")
        return self._slots[chunk]

    def _cancelled(self, state: BlockJob, i: int, store: bool) -> None:
        self._block_done(state, i, Outcome(ERROR, detail="tier shut down"), store)

    def _block_done(self, state: BlockJob, i: int, outcome: Outcome, store: bool) -> None:
        """Block ``i``'s outcome; the job's last one ends it (an expired job ended at its deadline)."""
        last = state.done(i, outcome)
        if last is None:
            self._deadlines.returned_late()
        elif last:
            self._deadlines.ended(state)
            (self._store_written if store else self._load_done)(state)

    # -- stores ----------------------------------------------------------------
    def _store_one(self, state: BlockJob, i: int) -> None:
        if not state.start(i):
            return  # the job expired while this block waited for a thread
        key = state.keys[i]
        try:
            slot = self._slot(state.chunks[i])
            size = self.storage.existing_size(key)
            if size is not None:
                outcome = Outcome(EXISTING, size)
            else:
                buf = self._deadlines.staging()
                if not state.with_slots(partial(np.copyto, buf, slot)):
                    outcome = Outcome(ERROR, detail="job expired")
                else:
                    outcome = Outcome(WRITTEN, self.storage.store(key, buf.data, self.options.fsync))
        except Exception as e:
            outcome = Outcome(ERROR, detail=_err(e))
        self._block_done(state, i, outcome, store=True)

    def _store_written(self, state: BlockJob) -> None:
        """All of a job's files are written (or failed): commit what is there."""
        if state.with_kind(WRITTEN, EXISTING):
            self._control.commit(state)
        else:
            self.jobs.fail(state.job, state.summary(state.with_kind(ERROR), "not stored"))

    def _finish_store(self, state: BlockJob, answer: CommitReport | CallFailed) -> None:
        """Control thread: the commit came back (the actor's report) or failed."""
        committed = state.with_kind(WRITTEN, EXISTING)
        if isinstance(answer, CallFailed):
            if answer.refused:
                # The live actor refused the commit: nobody accounts for the files we wrote.
                self.storage.delete([state.keys[i] for i in state.with_kind(WRITTEN)])
            # Otherwise the actor died or did not answer: the commit may have
            # happened, and a restarted actor rescans the root and adopts the
            # files, so they must stay (deleting them could leave its index,
            # or another engine's commit of the same key, without a file).
            self.jobs.fail(state.job, f"stored files not committed: {answer.why}")
            return
        evicted = set(answer.evicted)
        missing = set(answer.missing)
        if evicted:
            self._cache.invalidate(list(evicted), "fs")
        held = [state.keys[i] for i in committed if state.keys[i] not in evicted and state.keys[i] not in missing]
        if held:
            self.note_stored(held, self.holder_info, state.job.submit_time)
        for i in committed:
            if state.keys[i] in missing:
                state.outcomes[i] = Outcome(ERROR, detail="file evicted while committing")
        failed = state.with_kind(ERROR)
        written = len(state.with_kind(WRITTEN)) * self.block_size_bytes
        if not failed and state.error is None:
            self.jobs.succeed(state.job, transfer_bytes=written)
        else:
            ok = set(held) | evicted
            msg = state.error or state.summary(failed, "not stored")
            self.jobs.fail(state.job, msg, successful_keys=[k for k, s in zip(state.job.keys, state.keys) if s in ok])

    # -- loads -----------------------------------------------------------------
    def _load_one(self, state: BlockJob, i: int) -> None:
        if not state.start(i):
            return  # the job expired while this block waited for a thread
        key = state.keys[i]
        try:
            buf, slot = self._deadlines.staging(), self._slot(state.chunks[i])
            n = self.storage.load(key, buf.data)
            copied = state.with_slots(partial(np.copyto, slot, buf))
            outcome = Outcome(OK, n) if copied else Outcome(ERROR, detail="job expired")
        except FileNotFoundError as e:
            outcome = Outcome(MISSING, detail=_err(e))
        except FormatError as e:
            outcome = Outcome(CORRUPT, detail=str(e))
        except Exception as e:
            outcome = Outcome(ERROR, detail=_err(e))
        self._block_done(state, i, outcome, store=False)

    def _load_done(self, state: BlockJob) -> None:
        ok = state.with_kind(OK)
        if ok:
            self._control.touch([state.keys[i] for i in ok])
        if len(ok) == len(state.keys):
            self.jobs.succeed(state.job, transfer_bytes=len(ok) * self.block_size_bytes)
            return
        failed = [i for i, o in enumerate(state.outcomes) if o.kind != OK]
        self._cache.invalidate([state.keys[i] for i in failed], "fs")
        bad = [i for i in failed if state.outcomes[i].kind in (CORRUPT, MISSING)]
        if bad and not self._closed:
            self._control.remove(state, bad)  # finishes the job once the directory knows
        else:
            self._finish_load_failure(state, bad, None)

    def _finish_load_failure(self, state: BlockJob, bad: list[int], err: str | None) -> None:
        """The job's bad files were removed through the actor (``err``: it could not)."""
        corrupt = [i for i in bad if state.outcomes[i].kind == CORRUPT]
        if err is not None and corrupt:  # the actor could not: do it ourselves (and say so)
            _remove_corrupt(self.storage, self.removals, state, corrupt)
        ok = state.with_kind(OK)
        orig = list(state.job.keys)
        failed = [i for i, o in enumerate(state.outcomes) if o.kind != OK]
        self._cache.invalidate([state.keys[i] for i in failed], "fs")
        self.jobs.fail(state.job, state.summary(failed, "not loaded"), successful_keys=[orig[i] for i in ok])

    # -- lifecycle -------------------------------------------------------------
    def stats(self) -> HolderStats:
        """The root actor's stats (blocking; tools and tests): the tier's own in ``figures``."""
        return _answer("stats", self.actor.stats.remote(), HolderStats, self.options.control_timeout_s)

    def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names at the root's actor (blocking; tools):
        the files then age under LRU. How many were unpinned."""
        return _answer("unpin", self.actor.unpin.remote(which), int, self.options.control_timeout_s)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.leave_planner()
        self._pool.shutdown(wait=True)  # queued tasks are cancelled into failed results
        self._slots = np.empty((0, 0), np.uint8)  # let go of the primary region
        self._control.close()
        self.removals.close()
        for job in self.jobs.pending():
            self.jobs.fail(job, "fs tier shut down")


_T = TypeVar("_T")


def _answer(what: str, ref: ray.ObjectRef[object], expected: type[_T], timeout: float) -> _T:
    """The root actor's answer to a blocking call (tools), checked to be an ``expected``."""
    answer = ray.get(ref, timeout=timeout)
    if not isinstance(answer, expected):
        raise TypeError(f"fs root actor answered {what} with {type(answer).__name__}")
    return answer


def _remove_corrupt(storage: Storage, removals: RemovalLog, state: BlockJob, corrupt: list[int]) -> None:
    """Delete the job's ``corrupt`` block files from this engine, counted and logged."""
    keys = [state.keys[i] for i in corrupt]
    storage.delete(keys)
    removals.note(
        CORRUPT,
        [Removal(k.hex(), storage.path_of(k), state.outcomes[i].detail[:200]) for k, i in zip(keys, corrupt)],
    )


def _err(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or e}"
    return repr(e)
