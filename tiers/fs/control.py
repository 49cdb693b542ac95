"""``RootController``: an fs tier's only talker to its root's actor.

One thread per tier batches the commits, removes and touches that I/O threads
hand it into one actor call each per round, waits for the answers (never on
the scheduler thread) and reports each job's answer through the callbacks the
tier gave it. It also watches the actor (``ActorLiveness``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray

from raykv.core.background import SessionEnded, wait_answer
from raykv.core.contract import TransferJob
from raykv.core.handles import HolderHandle
from raykv.core.node import ray_session
from raykv.core.pins import PinBatch, cache_ttl_of
from raykv.core.tenants import tenant_of
from raykv.engine.polling import ActorLiveness
from tiers.fs.jobs import EXISTING, WRITTEN, BlockJob
from tiers.fs.messages import CommitBatch, CommitReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallFailed:
    """Why a call to the root actor brought no answer."""

    why: str
    #: The live actor raised: it did nothing. Otherwise it died or did not
    #: answer, and may have done what it was asked.
    refused: bool = False


#: A store job's commit came back (the actor's report) or failed.
OnCommitted = Callable[[BlockJob, "CommitReport | CallFailed"], None]
#: A load job's bad blocks (positions) were removed, or the removal failed (why).
OnRemoved = Callable[[BlockJob, list[int], "str | None"], None]
#: A job could not be handled at all (why).
OnFailed = Callable[[TransferJob, str], object]


class RootController:
    """Batches a tier's calls to its root actor, one round at a time."""

    def __init__(
        self,
        actor: HolderHandle,
        actor_name: str,
        namespace: str,
        timeout_s: float,
        on_committed: OnCommitted,
        on_removed: OnRemoved,
        on_failed: OnFailed,
    ) -> None:
        self.actor = actor
        self.timeout = timeout_s
        self.liveness = ActorLiveness(actor, f"fs root actor {actor_name}", name=actor_name, namespace=namespace)
        self._on_committed = on_committed
        self._on_removed = on_removed
        self._on_failed = on_failed
        self._cond = threading.Condition()
        self._commits: list[BlockJob] = []
        self._removes: list[tuple[BlockJob, list[int]]] = []
        self._touches: list[bytes] = []
        self._pins: dict[bytes, float] = {}  # key -> longest TTL asked this round
        self._closed = False
        self.rounds = 0
        self._session = ray_session()
        self._thread = threading.Thread(target=self._run, name="raykv-fs-control", daemon=True)
        self._thread.start()

    # -- producers (any thread) --------------------------------------------
    def commit(self, job: BlockJob) -> None:
        """Commit the job's written and existing blocks; reported to ``on_committed``."""
        with self._cond:
            self._commits.append(job)
            self._cond.notify()

    def remove(self, job: BlockJob, idx: list[int]) -> None:
        """Remove the job's blocks ``idx`` (corrupt or missing files); reported to ``on_removed``."""
        with self._cond:
            self._removes.append((job, idx))
            self._cond.notify()

    def touch(self, keys: list[bytes]) -> None:
        """Mark keys recently used (sent with the next round, unanswered)."""
        with self._cond:
            self._touches.extend(keys)
            self._cond.notify()

    def pin(self, keys: list[bytes], ttl_s: float) -> None:
        """Pin keys for ``ttl_s`` seconds or extend their pins (sent with the next round, unanswered)."""
        with self._cond:
            for k in keys:
                self._pins[k] = max(ttl_s, self._pins.get(k, 0.0))
            self._cond.notify()

    def close(self) -> None:
        """Finish what was handed in, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(self.timeout * 2 + 5)
        self.liveness.close()

    @property
    def alive(self) -> bool:
        return self.liveness.alive

    # -- the thread -----------------------------------------------------------
    def _run(self) -> None:
        session = self._session
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or self._commits or self._removes or self._touches or self._pins,
                    timeout=0.1,
                )
                commits, self._commits = self._commits, []
                removes, self._removes = self._removes, []
                touches, self._touches = self._touches, []
                pins, self._pins = self._pins, {}
                closed = self._closed
            if ray_session() != session:  # Ray shut down under us: no actor to finish them with
                for job in [*commits, *(job for job, _ in removes)]:
                    self._on_failed(job.job, "fs control: Ray shut down")
                return
            try:
                self._send_pins(pins)
                self._round(commits, removes, touches)
            except BaseException as e:  # never leave a job behind
                logger.exception("fs control round failed")
                for job in [*commits, *(job for job, _ in removes)]:
                    self._on_failed(job.job, f"fs control error: {e!r}")
            if closed:
                with self._cond:
                    if not (self._commits or self._removes or self._touches or self._pins):
                        return

    def _send_pins(self, pins: dict[bytes, float]) -> None:
        if pins:
            try:
                self.actor.pin.remote(PinBatch(tuple(pins), tuple(pins.values())))
            except Exception as e:
                logger.debug("fs pin not sent: %r", e)

    def _round(self, commits: list[BlockJob], removes: list[tuple[BlockJob, list[int]]], touches: list[bytes]) -> None:
        self.liveness.poll()
        if touches:
            try:
                self.actor.touch.remote(list(dict.fromkeys(touches)))
            except Exception as e:
                logger.debug("fs touch not sent: %r", e)
        if not (commits or removes):
            return
        self.rounds += 1
        commit_ref = self._call(lambda: self.actor.commit.remote(commit_batch(commits))) if commits else None
        remove_refs = [
            self._call(lambda: self.actor.remove.remote(keys, reason, details))  # called at once
            for reason, (keys, details) in removals_by_reason(removes).items()
        ]
        if commit_ref is not None:
            answer = self._get(commit_ref)
            if not isinstance(answer, CallFailed | CommitReport):
                answer = CallFailed(f"fs root actor answered a commit with {type(answer).__name__}", refused=True)
            for job in commits:
                self._on_committed(job, answer)
        if removes:
            failures = [a for a in map(self._get, remove_refs) if isinstance(a, CallFailed)]
            err = failures[0].why if failures else None
            for job, idx in removes:
                self._on_removed(job, idx, err)

    def _call(self, send: Callable[[], ray.ObjectRef]) -> ray.ObjectRef | CallFailed:
        try:
            return send()
        except Exception as e:
            return CallFailed(repr(e))

    def _get(self, ref: ray.ObjectRef | CallFailed) -> object:
        """The call's answer, or ``CallFailed``."""
        if isinstance(ref, CallFailed):
            return ref
        try:
            return wait_answer(ref, self.timeout, self._session)
        except SessionEnded:
            return CallFailed("fs control: Ray shut down")
        except ray.exceptions.GetTimeoutError:
            return CallFailed(f"fs root actor did not answer within {self.timeout}s")
        except ray.exceptions.RayActorError as e:  # died, or unreachable for now
            self.liveness.mark_dead(type(e).__name__)
            return CallFailed(f"fs root actor unavailable: {type(e).__name__}")
        except ray.exceptions.RayTaskError as e:  # the call raised; the actor lives on
            return CallFailed(f"fs root actor failed: {e.cause!r}", refused=True)
        except Exception as e:
            return CallFailed(f"fs root actor call failed: {e!r}")


def commit_batch(commits: list[BlockJob]) -> CommitBatch:
    """One commit of every written or existing block of ``commits``."""
    keys: list[bytes] = []
    sizes: list[int] = []
    tenants: list[str] = []
    ttls: list[float] = []
    verify: set[bytes] = set()
    for job in commits:
        tenant = tenant_of(job.job.req_context)
        ttl = cache_ttl_of(job.job.req_context) or 0.0
        for i in job.with_kind(WRITTEN, EXISTING):
            outcome = job.outcomes[i]
            keys.append(job.keys[i])
            sizes.append(outcome.size)
            tenants.append(tenant)
            ttls.append(ttl)
            if outcome.kind == EXISTING:
                verify.add(job.keys[i])
    pinned = tuple(ttls) if any(ttls) else ()
    return CommitBatch(tuple(keys), tuple(sizes), tuple(tenants), frozenset(verify), pinned)


def removals_by_reason(removes: list[tuple[BlockJob, list[int]]]) -> dict[str, tuple[list[bytes], list[str]]]:
    """Keys to remove and what was wrong with each, by outcome kind (``missing``, ``corrupt``)."""
    out: dict[str, tuple[list[bytes], list[str]]] = {}
    for job, idx in removes:
        for i in idx:
            keys, details = out.setdefault(job.outcomes[i].kind, ([], []))
            keys.append(job.keys[i])
            details.append(job.outcomes[i].detail)
    return out
