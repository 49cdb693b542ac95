"""``FsTier``: the engine-side client of a shared-storage root.

Runs in the engine's scheduler process. Block bytes go straight between the
primary region and block files (``storage``) on an I/O thread pool where loads
are served ahead of stores (``io_pool``); only keys and sizes go to the root's
actor (``actor.FsRootActor``), in one call per batch from a control thread:

- store job: write every missing block file (atomic, checksummed, optionally
  fsync'ed) -> one batched ``commit`` to the root actor (which registers the
  keys at the directory and evicts LRU files over capacity) -> JobResult.
- load job: read + verify each block into its primary slot -> JobResult
  (``successful_keys`` when some failed). Corrupt/truncated or missing files
  are ``remove``d via the actor (file deleted, directory updated) before the
  failure is reported, so the next lookup already misses.

Nothing here blocks the scheduler thread, and every job ends in exactly one
JobResult: I/O errors, a dead root actor, timeouts and shutdown all become
failed results.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from raykv.core import naming
from raykv.core.contract import ReqContext, TransferJob
from raykv.core.fields import namespace_option, opt
from raykv.core.identity import KVIdentity
from raykv.core.keys import OffloadKey
from raykv.core.placement import SHARED, HolderInfo
from raykv.core.tenants import tenant_of, tenant_quotas_option
from raykv.core.validate import ConfigError
from raykv.engine.actor_tier import DirectoryBackedTier
from raykv.engine.polling import ActorLiveness
from raykv.metrics.incidents import Removal, RemovalLog
from raykv.services.cluster import RaykvServices
from tiers.fs import format as fmt
from tiers.fs import io_pool
from tiers.fs.actor import FsRootActor, holder_info
from tiers.fs.format import FormatError
from tiers.fs.storage import canonical_root, check_root, open_storage, root_problem_here

logger = logging.getLogger(__name__)

GiB = 1024**3
#: How a control call's error starts when the live root actor raised (it did nothing).
_COMMIT_REFUSED = "fs root actor failed"


@dataclass
class FsOptions:
    root: str = opt(
        kind=str,
        check=check_root,
        doc="shared storage root: an absolute path (NFS/Lustre/EFS mount) or a pyarrow.fs URI (s3://bucket/prefix)",
    )
    namespace: str = namespace_option()
    capacity_bytes: int = opt(
        64 * GiB,
        kind=int,
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
    tenant_quotas: dict = tenant_quotas_option(
        "bytes of block files under the root", "Set when the root's actor starts"
    )


class _Job:
    """Per-job progress: one outcome per key; ``done`` is True exactly once."""

    __slots__ = ("job", "keys", "chunks", "outcomes", "_left", "_lock", "error")

    def __init__(self, job: TransferJob, keys: list[bytes], chunks: list[int]) -> None:
        self.job = job
        self.keys = keys
        self.chunks = chunks
        self.outcomes: list[tuple[str, Any]] = [("error", "not run")] * len(keys)
        self._left = len(keys)
        self._lock = threading.Lock()
        self.error: str | None = None

    def done(self, i: int, outcome: tuple[str, Any]) -> bool:
        with self._lock:
            self.outcomes[i] = outcome
            self._left -= 1
            return self._left == 0

    def with_kind(self, *kinds: str) -> list[int]:
        return [i for i, (kind, _) in enumerate(self.outcomes) if kind in kinds]


def _summary(job: _Job, idx: list[int], what: str) -> str:
    # Name each key by its own bytes (a scoped key opens with the identity tag, the same for all).
    parts = [f"{job.keys[i][fmt.TAG_BYTES :].hex()[:12]}: {job.outcomes[i][0]} ({job.outcomes[i][1]})" for i in idx[:3]]
    more = f"; +{len(idx) - 3} more" if len(idx) > 3 else ""
    return f"{len(idx)} of {len(job.keys)} keys {what}: " + "; ".join(parts) + more


class _Controller:
    """The tier's only talker to the root actor: batches commits, removes and
    touches into one call each per round, and watches the actor."""

    def __init__(self, tier: "FsTier") -> None:
        self.tier = tier
        self.actor = tier.actor
        self.timeout = tier.options.control_timeout_s
        self.liveness = ActorLiveness(self.actor, f"fs root actor {tier.holder_info.actor_name}")
        self._cond = threading.Condition()
        self._commits: list[_Job] = []
        self._removes: list[tuple[_Job, list[int]]] = []
        self._touches: list[bytes] = []
        self._closed = False
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="raykv-fs-control", daemon=True)
        self._thread.start()

    # -- producers (any thread) --------------------------------------------
    def commit(self, job: _Job) -> None:
        self._put(lambda: self._commits.append(job))

    def remove(self, job: _Job, idx: list[int]) -> None:
        self._put(lambda: self._removes.append((job, idx)))

    def touch(self, keys: list[bytes]) -> None:
        self._put(lambda: self._touches.extend(keys))

    def _put(self, add: Any) -> None:
        with self._cond:
            add()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(self.timeout * 2 + 5)
        self.liveness.close()

    # -- the thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or self._commits or self._removes or self._touches, timeout=0.1
                )
                commits, self._commits = self._commits, []
                removes, self._removes = self._removes, []
                touches, self._touches = self._touches, []
                closed = self._closed
            try:
                self._round(commits, removes, touches)
            except BaseException as e:  # never leave a job behind
                logger.exception("fs control round failed")
                for job in commits:
                    self.tier.jobs.fail(job.job, f"fs control error: {e!r}")
                for job, _ in removes:
                    self.tier.jobs.fail(job.job, f"fs control error: {e!r}")
            if closed:
                with self._cond:
                    if not (self._commits or self._removes or self._touches):
                        return

    def _round(self, commits: list[_Job], removes: list[tuple[_Job, list[int]]], touches: list[bytes]) -> None:
        self.liveness.poll()
        if touches:
            try:
                self.actor.touch.remote(list(dict.fromkeys(touches)))
            except Exception as e:
                logger.debug("fs touch not sent: %r", e)
        if not (commits or removes):
            return
        self.rounds += 1
        commit_ref = remove_refs = None
        if commits:
            keys: list[bytes] = []
            sizes: list[int] = []
            verify: list[bytes] = []
            tenants: list[str] = []
            for job in commits:
                tenant = tenant_of(job.job.req_context)
                for i in job.with_kind("written", "existing"):
                    kind, size = job.outcomes[i]
                    keys.append(job.keys[i])
                    sizes.append(size)
                    tenants.append(tenant)
                    if kind == "existing":
                        verify.append(job.keys[i])
            commit_ref = self._call(lambda: self.actor.commit.remote(keys, sizes, verify, tenants))
        if removes:
            by_reason: dict[str, tuple[list[bytes], list[str]]] = {}
            for job, idx in removes:
                for i in idx:
                    kind, detail = job.outcomes[i]
                    keys_of, details_of = by_reason.setdefault(kind, ([], []))
                    keys_of.append(job.keys[i])
                    details_of.append(str(detail))
            remove_refs = [
                self._call(lambda r=r, ks=ks, ds=ds: self.actor.remove.remote(ks, r, ds))
                for r, (ks, ds) in by_reason.items()
            ]
        if commits:
            result, err = self._get(commit_ref)
            for job in commits:
                self.tier._finish_store(job, result, err)
        if removes:
            errs = [self._get(ref)[1] for ref in remove_refs]
            err = next((e for e in errs if e), None)
            for job, idx in removes:
                self.tier._finish_load_failure(job, idx, err)

    def _call(self, send: Any) -> Any:
        try:
            return send()
        except Exception as e:
            return e

    def _get(self, ref: Any) -> tuple[Any, str | None]:
        if isinstance(ref, Exception):
            return None, repr(ref)
        try:
            return ray.get(ref, timeout=self.timeout), None
        except ray.exceptions.GetTimeoutError:
            return None, f"fs root actor did not answer within {self.timeout}s"
        except ray.exceptions.RayActorError as e:  # died, or unreachable for now
            self.liveness.mark_dead(type(e).__name__)
            return None, f"fs root actor unavailable: {type(e).__name__}"
        except ray.exceptions.RayTaskError as e:  # the call raised; the actor lives on
            return None, f"{_COMMIT_REFUSED}: {e.cause!r}"
        except Exception as e:
            return None, f"fs root actor call failed: {e!r}"

    @property
    def alive(self) -> bool:
        return self.liveness.alive


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
        **_: Any,
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
        self._pool = io_pool.IoPool(options.io_threads, name="raykv-fs-io")
        self._control = _Controller(self)
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
    def start_services(cls, services: RaykvServices, options: FsOptions) -> Any:
        """Start (or find) the root's ``FsRootActor``; returns its handle."""
        root = canonical_root(options.root)
        problem = root_problem_here(root)
        if problem:
            raise ConfigError("root", problem)
        actor = FsRootActor.options(
            name=naming.fs_actor(root),
            namespace=services.namespace,
            lifetime="detached",
            get_if_exists=True,
        ).remote(root, options.capacity_bytes, services.namespace, tenant_quotas=dict(options.tenant_quotas))
        cls.start_holder_actor(actor, f"fs tier root {root!r}: the root actor", options.capacity_bytes, timeout=300)
        return actor

    # -- contract ------------------------------------------------------------
    def can_load(self, holder: HolderInfo) -> bool:
        return holder.holder_id == self.holder_id and self.holder_alive

    def poll_jobs(self) -> None:
        """Nothing to poll: I/O threads and the control thread finish jobs."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if keys and not self._closed:
            scope = self.key_scope(req_context)
            self._control.touch([self.scope(bytes(k), scope=scope) for k in keys])

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
            state = _Job(job, keys, chunks)
            if not keys:
                self.jobs.succeed(job, transfer_bytes=0)
                return
            run = self._store_one if store else self._load_one
            tasks = [
                (lambda i=i: run(state, i), lambda i=i: self._cancelled(state, i, store)) for i in range(len(keys))
            ]
            self._pool.submit_many(io_pool.STORE if store else io_pool.LOAD, tasks)
        except Exception as e:
            self.jobs.fail(job, f"cannot submit: {e!r}")

    def _slot(self, chunk: int) -> memoryview:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk id {chunk} out of range [0, {self.num_chunks})")
        return memoryview(self._slots[chunk])

    def _cancelled(self, state: _Job, i: int, store: bool) -> None:
        if state.done(i, ("error", "tier shut down")):
            (self._store_written if store else self._load_done)(state)

    # -- stores ----------------------------------------------------------------
    def _store_one(self, state: _Job, i: int) -> None:
        key = state.keys[i]
        try:
            slot = self._slot(state.chunks[i])
            size = self.storage.existing_size(key)
            if size is not None:
                outcome: tuple[str, Any] = ("existing", size)
            else:
                size = self.storage.store(key, slot, self.options.fsync)
                outcome = ("written", size)
        except Exception as e:
            outcome = ("error", _err(e))
        if state.done(i, outcome):
            self._store_written(state)

    def _store_written(self, state: _Job) -> None:
        """All of a job's files are written (or failed): commit what is there."""
        if state.with_kind("written", "existing"):
            self._control.commit(state)
        else:
            self.jobs.fail(state.job, _summary(state, state.with_kind("error"), "not stored"))

    def _finish_store(self, state: _Job, result: dict[str, list[bytes]] | None, err: str | None) -> None:
        """Control thread: the commit came back (``result``) or failed (``err``)."""
        committed = state.with_kind("written", "existing")
        if err is not None:
            if err.startswith(_COMMIT_REFUSED):
                # The live actor refused the commit: nobody accounts for the files we wrote.
                self.storage.delete([state.keys[i] for i in state.with_kind("written")])
            # Otherwise the actor died or did not answer: the commit may have
            # happened, and a restarted actor rescans the root and adopts the
            # files, so they must stay (deleting them could leave its index,
            # or another engine's commit of the same key, without a file).
            self.jobs.fail(state.job, f"stored files not committed: {err}")
            return
        evicted = set(result["evicted"])
        missing = set(result["missing"])
        if evicted:
            self._cache.invalidate(list(evicted), "fs")
        held = [state.keys[i] for i in committed if state.keys[i] not in evicted and state.keys[i] not in missing]
        if held:
            self._cache.note_stored(held, self.holder_info)
        for i in committed:
            if state.keys[i] in missing:
                state.outcomes[i] = ("error", "file evicted while committing")
        failed = state.with_kind("error")
        written = len(state.with_kind("written")) * self.block_size_bytes
        if not failed and state.error is None:
            self.jobs.succeed(state.job, transfer_bytes=written)
        else:
            ok = set(held) | evicted
            msg = state.error or _summary(state, failed, "not stored")
            self.jobs.fail(state.job, msg, successful_keys=[k for k, s in zip(state.job.keys, state.keys) if s in ok])

    # -- loads -----------------------------------------------------------------
    def _load_one(self, state: _Job, i: int) -> None:
        key = state.keys[i]
        try:
            n = self.storage.load(key, self._slot(state.chunks[i]))
            outcome: tuple[str, Any] = ("ok", n)
        except FileNotFoundError as e:
            outcome = ("missing", _err(e))
        except FormatError as e:
            outcome = ("corrupt", str(e))
        except Exception as e:
            outcome = ("error", _err(e))
        if state.done(i, outcome):
            self._load_done(state)

    def _load_done(self, state: _Job) -> None:
        ok = state.with_kind("ok")
        if ok:
            self._control.touch([state.keys[i] for i in ok])
        if len(ok) == len(state.keys):
            self.jobs.succeed(state.job, transfer_bytes=len(ok) * self.block_size_bytes)
            return
        failed = [i for i in range(len(state.keys)) if state.outcomes[i][0] != "ok"]
        self._cache.invalidate([state.keys[i] for i in failed], "fs")
        bad = [i for i in failed if state.outcomes[i][0] in ("corrupt", "missing")]
        if bad and not self._closed:
            self._control.remove(state, bad)  # finishes the job once the directory knows
        else:
            self._finish_load_failure(state, bad, None)

    def _finish_load_failure(self, state: _Job, bad: list[int], err: str | None) -> None:
        corrupt = [i for i in bad if state.outcomes[i][0] == "corrupt"]
        if err is not None and corrupt:
            keys = [state.keys[i] for i in corrupt]
            self.storage.delete(keys)  # the actor could not: do it ourselves (and say so)
            self.removals.note(
                "corrupt",
                [
                    Removal(k.hex(), self.storage.path_of(k), str(state.outcomes[i][1])[:200])
                    for k, i in zip(keys, corrupt)
                ],
            )
        ok = state.with_kind("ok")
        orig = list(state.job.keys)
        failed = [i for i in range(len(state.keys)) if state.outcomes[i][0] != "ok"]
        self._cache.invalidate([state.keys[i] for i in failed], "fs")
        self.jobs.fail(
            state.job,
            _summary(state, failed, "not loaded"),
            successful_keys=[orig[i] for i in ok],
        )

    # -- lifecycle -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return ray.get(self.actor.stats.remote(), timeout=self.options.control_timeout_s)

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


def _err(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        import errno as _errno

        return f"{_errno.errorcode.get(e.errno, e.errno)}: {e.strerror or e}"
    return repr(e)
