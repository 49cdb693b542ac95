"""The engine-side base of tiers whose blocks live in holder actors (object_store, fs).

``DirectoryBackedTier`` does what such tiers share in the engine process:
attach to raykv's services, answer ``lookup`` from the process's
``LookupCache`` (never blocking), decide which tier of the process serves a
key (``raykv.core.placement.LoadPlanner``: one rule), count jobs and metrics,
report KV events from the holder's log (``HoldingsPage``s), and start or find
the holder actor (``start_holder_actor``: wait for its ``HolderReady``, warn on
settings that differ from those asked). ``ActorCallTier`` turns each job's ``StoreAnswer`` /
``LoadAnswer`` into its result. A tier adds its data path and ``can_load``;
the messages are ``raykv.core.wire``'s."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import cast

import numpy as np
import ray
from ray.actor import ActorHandle

from raykv.core.contract import (
    JobResult,
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    SecondaryTier,
    TierEvent,
    TransferJob,
)
from raykv.core.errors import RaykvError, root_cause
from raykv.core.handles import HolderHandle
from raykv.core.identity import KVIdentity
from raykv.core.jobs import JobTracker, MeteredJobTracker
from raykv.core.keys import GROUP_IDX_BYTES, MAX_KEY_BYTES, OffloadKey, pending_key, validate_key
from raykv.core.outcomes import CallOutcome
from raykv.core.tenants import TenantSharing
from raykv.core.units import fmt_bytes
from raykv.core.wire import HolderInfo, HolderReady, LoadAnswer, StoreAnswer
from raykv.engine.pending import ComputeOnce, PendingBook, pending_book, request_blocks
from raykv.engine.polling import ActorLiveness, HoldingsFeed
from raykv.metrics.recorders import TierMetrics
from raykv.metrics.step_cost import COUNTS
from raykv.services.cluster import RaykvServices, attach

logger = logging.getLogger(__name__)


def start_holder_actor(
    actor: HolderHandle, what: str, requested_capacity: int, timeout: float, settings: object | None = None
) -> HolderReady:
    """Wait until a holder actor (just started, or found running) is ready; returns
    its ``ready()`` answer. ``RaykvError`` when it does not start; a warning naming
    each setting it runs with other than asked (``settings``: the tier's dataclass;
    without it, the capacity alone): a running actor keeps its own."""
    try:
        ready = ray.get(actor.ready.remote(), timeout=timeout)
    except Exception as e:
        if isinstance(e, ray.exceptions.RayTaskError):  # ready() raised: the actor lives
            # Alive but its start-up failed: it serves nothing and would fail every later
            # start that finds it by name; the next start (say, once storage is mounted) tries anew.
            ray.kill(cast(ActorHandle, actor))
        raise RaykvError(f"{what} did not start: {root_cause(e)}") from e
    if not isinstance(ready, HolderReady):
        raise RaykvError(f"{what} answered ready() with a {type(ready).__name__}, not a HolderReady")
    differences = setting_differences(ready.settings, settings)
    if not differences and ready.requested_capacity_bytes != requested_capacity:
        differences = [_difference("capacity_bytes", ready.requested_capacity_bytes, requested_capacity)]
    if differences:
        logger.warning(
            "%s already runs with other settings: %s; keeping them (to change them: `raykv stop`, then `raykv start`)",
            what,
            "; ".join(differences),
        )
    warn_if_capped(what, ready)
    return ready


def setting_differences(running: object, asked: object) -> list[str]:
    """Each field of ``asked`` (a dataclass) that ``running`` (one of the same type) has
    otherwise, as ``"name running (asked value)"``; none when either is not such a dataclass."""
    if not dataclasses.is_dataclass(asked) or type(running) is not type(asked):
        return []
    return [
        _difference(f.name, getattr(running, f.name), getattr(asked, f.name))
        for f in dataclasses.fields(asked)
        if getattr(running, f.name) != getattr(asked, f.name)
    ]


def _difference(name: str, running: object, asked: object) -> str:
    def say(value: object) -> str:
        return fmt_bytes(value) if name.endswith("_bytes") and isinstance(value, int) else repr(value)

    return f"{name} {say(running)} (asked {say(asked)})"


def warn_if_capped(what: str, ready: HolderReady) -> None:
    """Warn (the CLI prints it) when a holder runs with less than it was asked
    for, e.g. an object store tier capped to its node's plasma."""
    if ready.capacity_bytes < ready.requested_capacity_bytes:
        logger.warning(
            "%s runs with capacity_bytes=%s, not the %s asked for (what its node can hold)",
            what,
            fmt_bytes(ready.capacity_bytes),
            fmt_bytes(ready.requested_capacity_bytes),
        )


class DirectoryBackedTier(SecondaryTier):
    """A tier whose blocks are found through the cluster directory.

    ``lookup`` answers from the process's ``LookupCache``: unknown keys return
    RETRY and are resolved in one batched directory call at the end of the
    step (``on_schedule_end``). Subclasses say which holders they can read
    (``can_load``) and implement the data path; ``serves`` then answers for
    the whole process, so only the tier that loads from the chosen holder
    answers HIT.
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
        self._cache = self.services.lookup_cache
        book = pending_book(self.services)
        if book is not None:  # a key is a miss of the process when none of its tiers loads it
            loadable = lambda hs: self.services.planner.source(self.key_tag, hs) is not None  # noqa: E731
            self._pending = ComputeOnce(book, self._cache, loadable, self._scoped_prefix)
        self.jobs: JobTracker = MeteredJobTracker(_Accounting(self.metrics, book, self.scoped), self.block_size_bytes)
        self.services.register_identity(self.identity)
        self._events: HoldingsFeed | None = None
        self.services.planner.add(self.key_tag, self)
        self.tenant_sharing = TenantSharing(getattr(self.services.config, "shared_tenants", None))
        self._lookup_wait_s = float(getattr(self.services.config, "lookup_wait_ms", 0.0)) / 1000
        self._retry_budget_s = float(getattr(self.services.config, "lookup_retry_budget_ms", 50.0)) / 1000

    #: Compute once (``raykv.engine.pending``): None when off for the namespace.
    _pending: ComputeOnce | None = None

    # -- KV events -----------------------------------------------------------
    #: The holder actor whose holdings this tier reports (set by subclasses).
    actor: HolderHandle
    #: Its liveness, polled without blocking (set by subclasses).
    liveness: ActorLiveness | None = None

    def enable_events(self) -> None:
        """Report this identity's blocks in the holder actor as ``TierEvent``s
        (``take_events``): a snapshot first, then stores and removals."""
        actor: HolderHandle | None = getattr(self, "actor", None)  # None: the subclass has not set it
        if self._events is None and actor is not None:
            self._events = HoldingsFeed(actor, self.key_tag)

    def take_events(self) -> list[TierEvent]:
        if self._events is None:
            return []
        self._events.poll()
        return self._events.take()

    @abstractmethod
    def can_load(self, holder: HolderInfo) -> bool:
        """Whether this tier can read ``holder``'s blocks now (reachable, its actor alive)."""

    @property
    def holder_alive(self) -> bool:
        """Whether this tier's holder actor is up, as last polled (never blocks)."""
        return self.liveness is None or self.liveness.alive

    def serves(self, holders: list[HolderInfo]) -> bool:
        """Whether this tier should load a key held by ``holders``: it reads
        the holder ``raykv.core.placement.choose`` picks among those the process's
        tiers can read."""
        source = self.services.planner.source(self.key_tag, holders)
        return source is not None and self.can_load(source)

    def leave_planner(self) -> None:
        """Stop serving lookups of this process (at ``shutdown``)."""
        self.services.planner.remove(self.key_tag, self)

    start_holder_actor = staticmethod(start_holder_actor)

    @abstractmethod
    def poll_jobs(self) -> None:
        """Move completed transfers into ``self.jobs`` without blocking."""

    # -- contract ------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        raw: bytes = key
        if type(raw) is not bytes:
            try:
                raw = validate_key(raw)
            except ValueError:
                return LookupResult.MISS  # a malformed key is nobody's: never batch it
        elif not GROUP_IDX_BYTES < len(raw) <= MAX_KEY_BYTES:
            return LookupResult.MISS
        return self._lookup_scoped(self.scope(raw, req_context), req_context)

    def _lookup_scoped(self, key: bytes, req_context: ReqContext | None = None) -> LookupResult:
        self._cache.poll()
        holders = self._cache.get(key)
        if holders is None and req_context is not None and self._resolve_prefix(key, req_context):
            holders = self._cache.get(key)
        if holders is None:
            self._cache.request(key)  # asked anyway: the answer serves later requests
            if req_context is not None:
                pending = self._pending
                held_back = pending is not None and pending.held_back(req_context)
                if held_back or self._retry_budget_spent(req_context):
                    # it computes them, unknown or not: unless another engine claimed them first
                    if pending is None or not pending.unknown(key, req_context):
                        self.metrics.lookup(LookupResult.MISS)
                        return LookupResult.MISS
                req_context.retries += 1
            self.metrics.lookup(LookupResult.RETRY)
            return LookupResult.RETRY
        result = LookupResult.HIT if self.serves(holders) else LookupResult.MISS
        if self._pending is not None and req_context is not None:
            result = self._pending.lookup(key, holders, result, req_context)
        self.metrics.lookup(result)  # a local count; flushed to Ray once per step
        return result

    def _scoped_prefix(self, req_context: ReqContext) -> list[bytes]:
        """The request's prefix keys as this tier scopes them (empty when the engine does not say)."""
        if req_context.prefix_keys is None:
            return []
        scope = self.key_scope(req_context)
        try:
            return [
                self.scope(k, scope=scope)
                for k in req_context.prefix_keys()
                if type(k) is bytes and GROUP_IDX_BYTES < len(k) <= MAX_KEY_BYTES
            ]
        except Exception as e:  # the engine's bookkeeping: never fail a lookup over it
            logger.debug("prefix keys unavailable: %r", e)
            return []

    def _retry_budget_spent(self, req_context: ReqContext) -> bool:
        """Whether the request has been held back by RETRY for ``lookup_retry_budget_ms`` (its
        own ``retry_budget_s`` when set) since its first RETRY in consecutive lookup rounds (a
        round without one ends the run: a request queued for other reasons, or back after a
        preemption, gets its budget again). Spent: counted (``retry_budget_miss``)."""
        budget = req_context.retry_budget_s
        if budget is None:
            budget = self._retry_budget_s
            if self._pending is not None:  # (0 while its compute time is not measured)
                budget = max(budget, self._pending.book.answer_budget_s(request_blocks(req_context)))
        now = time.monotonic()
        current = self._cache.round
        if req_context.retry_since is None or req_context.retry_round < current - 1:
            req_context.retry_since = now
        req_context.retry_round = current
        spent = now - req_context.retry_since >= budget
        if spent:
            self.metrics.retry_budget_miss()
            logger.debug(
                "raykv: %s: no directory answer after %.0f ms of RETRY (budget %.0f ms): computes",
                req_context.req_id,
                (now - req_context.retry_since) * 1000,
                budget * 1000,
            )
        return spent

    def _resolve_prefix(self, key: bytes, req_context: ReqContext) -> bool:
        """At a request's first unknown key: look up its whole prefix (or this key) in one
        directory call, waiting up to ``lookup_wait_ms`` while this process's round trips fit
        in it (``RoundTrips.wait_budget``): HIT and MISS in the step that asked. True: answered now."""
        if req_context.prefix_resolved:
            return False
        req_context.prefix_resolved = True
        keys = [key, *self._scoped_prefix(req_context)]
        if len(keys) == 1 and req_context.prefix_keys is None and self._lookup_wait_s <= 0:
            return False  # nothing to gain over the step's batched call
        if self._pending is not None:  # who computes them now, answered in the same call
            keys += [pending_key(k) for k in keys]
        budget = self._cache.round_trips.wait_budget(self._lookup_wait_s)
        return self._cache.resolve(keys, budget, unanswered=self.metrics.view_unanswered)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._pending is not None:
            self._pending.book.idle.started(req_context.req_id)
        return self.services.policy.decide(self.tier_type, req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._pending is not None:
            self._pending.finished(req_context)

    def on_schedule_end(self) -> None:
        self._cache.flush()
        self.metrics.flush()
        if self._events is not None:
            self._events.poll()
        if self._pending is not None:  # last: the step's calls are sent before an idle step pauses
            self._pending.book.flush()
            self._pending.book.idle.step_end()

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

    def note_stored(self, keys: list[bytes], holder: HolderInfo, submitted: float | None = None) -> None:
        """``holder`` now holds ``keys`` (scoped), stored by this process from a job submitted at
        ``submitted`` (monotonic s, when known): the process's answers say so, and their pending entries end."""
        self._cache.note_stored(keys, holder)
        if self._pending is not None:
            self._pending.book.stored(keys, submitted)

    def scoped(self, keys: Collection[OffloadKey], req_context: ReqContext | None) -> list[bytes]:
        """``keys`` validated (``ValueError``), in ``req_context``'s identity and tenant scope."""
        scope = self.key_scope(req_context)
        return [self.scope(validate_key(k), scope=scope) for k in keys]

    def job_slots(self, job: TransferJob) -> tuple[list[bytes], list[int]]:
        """A submitted job's validated, identity-scoped keys and its chunk ids (``ValueError`` when
        malformed), in the job's tenant scope. Results name the job's own keys."""
        keys = self.scoped(job.keys, job.req_context)
        ids = np.asarray(job.chunk_ids)
        if ids.size and ids.dtype.kind not in "iu":  # never turn 2.7 or "3" into a slot
            raise ValueError(f"chunk ids must be ints, got {ids.dtype} values")
        chunks = [int(c) for c in ids.reshape(-1)]
        if len(keys) != len(chunks):
            raise ValueError(f"{len(keys)} keys but {len(chunks)} chunk ids")
        if self._pending is not None and not job.is_promotion:  # their pending entries outlive the request
            self._pending.book.storing(keys)
        return keys, chunks

    def lookup_blocking(
        self, keys: Collection[OffloadKey], timeout: float = 10.0, req_context: ReqContext | None = None
    ) -> list[LookupResult]:
        """Resolve ``keys`` now for ``req_context``'s tenant (tools, tests); unheld ones ask the directory."""
        scoped = self.scoped(keys, req_context)
        unheld = [k for k in scoped if not self._cache.get(k)]
        self._cache.invalidate(unheld)
        for k in unheld:
            self._cache.request(k)
        self._cache.wait(timeout)
        return [self._lookup_scoped(k) for k in scoped]


class _Accounting:
    """Where a tier's finished jobs are counted: its metrics, and for the compute-once
    rule its loads' times (``PendingBook.observe_load``) and its failed stores, whose
    blocks' pending entries end (``PendingBook.storing``)."""

    def __init__(
        self,
        metrics: TierMetrics,
        pending: PendingBook | None,
        scoped: Callable[[Collection[OffloadKey], ReqContext | None], list[bytes]],
    ) -> None:
        self.metrics = metrics
        self.pending = pending
        self._scoped = scoped

    def job_finished(self, job: TransferJob, result: JobResult, block_bytes: int) -> None:
        self.metrics.job_finished(job, result, block_bytes)
        if self.pending is None:
            return
        if job.is_promotion:
            if result.success and result.transfer_time is not None:
                self.pending.observe_load(result.transfer_time, len(job.keys))
        elif not result.success:
            try:
                keys = self._scoped(job.keys, job.req_context)
            except ValueError:
                return  # malformed: refused before any store began
            self.pending.storing(keys, change=-1)


@dataclass
class _InFlight:
    kind: str  # "store" or "load"
    job: TransferJob
    keys: list[bytes]
    deadline: float  # monotonic
    outcome: CallOutcome


class ActorCallTier(DirectoryBackedTier):
    """A ``DirectoryBackedTier`` whose every job is one call to its node's
    holder actor (object_store, the example node tier).

    ``send_job`` tracks the call; ``poll_jobs`` finishes each job exactly
    once: from the actor's answer (a store call answers a ``StoreAnswer``, a
    load call a ``LoadAnswer``, both ``raykv.core.wire``; ``finish_job``), or
    as failed when the call raised, answered anything else, the actor died,
    or ``job_timeout_s`` passed. A failed load forgets the cached answers of
    its keys, so the next lookup asks the directory again.
    """

    #: Seconds a job's actor call may take before the job fails (set by subclasses).
    job_timeout_s: float = 60.0
    #: This tier's holder (set by subclasses): stored keys are noted under it.
    holder_info: HolderInfo
    #: Seconds before ``job_timeout_s`` after which the actor copies no block of a
    #: load, so no copy lands after the job failed (the engine may reuse its slots).
    DEADLINE_GRACE_S = 2.0
    #: Most seconds a timed-out load's chunks are held for its call (vLLM 0.34+): past the
    #: deadline the actor starts no block's copy, so only a stalled actor takes this long.
    HOLD_AFTER_TIMEOUT_S = 10.0

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        namespace: str,
        services: RaykvServices | None = None,
        identity: KVIdentity | None = None,
    ) -> None:
        super().__init__(primary_kv_view, tier_type, namespace, services, identity)
        self._calls_lock = threading.Lock()
        self._inflight: list[_InFlight] = []
        #: Timed-out loads' calls still running, each with its result's ``deferred_release``
        #: (set when the call ends, or ``HOLD_AFTER_TIMEOUT_S`` after the timeout at most).
        self._held: list[tuple[CallOutcome, threading.Event, float]] = []
        self._closed = False

    def finish_job(self, kind: str, job: TransferJob, keys: list[bytes], answer: StoreAnswer | LoadAnswer) -> None:
        """Turn the actor's answer to ``kind`` job ``job`` (its scoped ``keys``) into the job's result.

        A ``StoreAnswer`` has the bytes stored, or the ``error`` why nothing
        new was; a ``LoadAnswer`` the positions (in ``keys``) that loaded and
        why each other one did not: a load succeeds or fails key by key.
        """
        if isinstance(answer, StoreAnswer):
            if answer.error:
                self.jobs.fail(job, f"{self.tier_type} store failed: {answer.error}")
            else:
                self.note_stored(keys, self.holder_info, job.submit_time)
                self.jobs.succeed(job, transfer_bytes=answer.bytes)
            return
        errors = answer.errors
        if not errors:
            self.jobs.succeed(job, transfer_bytes=answer.bytes)
            return
        self._cache.invalidate([keys[i] for i in errors], self.tier_type)
        originals = list(job.keys)
        ok = [originals[i] for i in answer.ok]
        shown = "; ".join(f"{keys[i].hex()[:12]}: {why}" for i, why in list(errors.items())[:3])
        more = f"; +{len(errors) - 3} more" if len(errors) > 3 else ""
        self.jobs.fail(job, f"{len(errors)} of {len(keys)} keys not loaded: {shown}{more}", successful_keys=ok)

    def load_deadline(self) -> float:
        """Wall-clock time after which the actor must not start a load's copy."""
        return time.time() + max(0.05, self.job_timeout_s - self.DEADLINE_GRACE_S)

    def send_job(
        self, kind: str, job: TransferJob, call: Callable[[list[bytes], list[int]], ray.ObjectRef[object]]
    ) -> None:
        """Track ``job`` and send ``call(scoped keys, chunk ids)``; any error becomes its failed result."""
        self.jobs.begin(job)
        try:
            keys, chunks = self.job_slots(job)
            if self._closed:
                raise RuntimeError(f"{self.tier_type} tier is shut down")
            if not keys:
                self.jobs.succeed(job, transfer_bytes=0)
                return
            entry = _InFlight(kind, job, keys, time.monotonic() + self.job_timeout_s, CallOutcome(call(keys, chunks)))
            with self._calls_lock:
                self._inflight.append(entry)
        except Exception as e:  # a job must end in a result, whatever happens
            self.jobs.fail(job, f"{self.tier_type} {kind} not submitted: {e!r}")

    def poll_jobs(self) -> None:
        if not self._closed and self.liveness is not None:
            self.liveness.poll()
        now = time.monotonic()
        with self._calls_lock:
            if self._held:
                self._release_held(now)
            if not self._inflight:
                return
            COUNTS.polls += 1
            finished: list[_InFlight] = []
            waiting: list[_InFlight] = []
            for e in self._inflight:  # one read of each outcome: it may end meanwhile
                (finished if e.outcome.finished or now > e.deadline else waiting).append(e)
            if not finished:
                return
            self._inflight = waiting
        for entry in finished:
            self._finish(entry)

    def _release_held(self, now: float) -> None:
        """Set the ``deferred_release`` of each timed-out load whose call ended, or that
        was held ``HOLD_AFTER_TIMEOUT_S``."""
        held = []
        for outcome, release, until in self._held:
            if outcome.finished or now > until:
                release.set()
            else:
                held.append((outcome, release, until))
        self._held = held

    def _finish(self, entry: _InFlight) -> None:
        job, kind = entry.job, entry.kind
        expected = StoreAnswer if kind == "store" else LoadAnswer
        done, answer, exc = entry.outcome.poll()
        if not done:
            error = f"{self.tier_type} {kind} timed out after {self.job_timeout_s}s"
            if kind == "load":  # the actor may still be copying: vLLM 0.34+ holds the chunks until the call ends
                release = threading.Event()
                with self._calls_lock:
                    self._held.append((entry.outcome, release, time.monotonic() + self.HOLD_AFTER_TIMEOUT_S))
                self.jobs.fail(job, error, deferred_release=release)
                self._cache.invalidate(entry.keys, self.tier_type)
                return
        else:
            if exc is None and isinstance(answer, expected):
                self.finish_job(kind, job, entry.keys, answer)
                return
            if exc is None:
                error = f"{self.tier_type} {kind} failed: the actor answered a {type(answer).__name__}"
            elif isinstance(exc, ray.exceptions.RayActorError):
                error = f"{self.tier_type} actor of node {self.node_id} unavailable: {type(exc).__name__}"
            else:
                error = f"{self.tier_type} {kind} failed: {exc!r}"
        self.jobs.fail(job, error)
        if kind == "load":
            self._cache.invalidate(entry.keys, self.tier_type)

    def has_pending_work(self) -> bool:
        with self._calls_lock:
            inflight = bool(self._inflight or self._held)
        return inflight or super().has_pending_work()

    def drain_jobs(self, timeout: float = 300.0) -> None:
        """Every job ends, and (vLLM 0.34+ asserts it at ``reset_cache``) every held
        load's ``deferred_release`` is set: once its call ends, or its hold runs out."""
        super().drain_jobs(timeout)
        while True:
            with self._calls_lock:
                self._release_held(time.monotonic())
                if not self._held:
                    return
            time.sleep(0.005)

    def close_calls(self) -> None:
        """At ``shutdown``: stop serving, and fail what is still in flight."""
        if self._closed:
            return
        self._closed = True
        self.leave_planner()
        self.poll_jobs()
        with self._calls_lock:
            left, self._inflight = self._inflight, []
            held, self._held = self._held, []
        for entry in left:
            self.jobs.fail(entry.job, f"{self.tier_type} tier shut down")
        for _, release, _ in held:  # vLLM 0.34+ needs every release set before shutdown returns
            release.set()
        if self.liveness is not None:
            self.liveness.close()
