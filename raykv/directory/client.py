"""Engine-side access to the directory: batched, and never blocking the scheduler.

- ``DirectoryClient``: batched register / unregister / lookup, split per shard
  (one actor call per shard per batch).
- ``LookupCache``: per-key answers for tiers' ``lookup``; unknown keys return
  RETRY, are sent in one batch at ``flush`` (end of the scheduler step) and
  resolved by the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError

from raykv.core.keys import bytes_and_length, checked_keys, shard_of
from raykv.core.logs import Throttled
from raykv.core.outcomes import CallOutcome, wait_all
from raykv.core.placement import PrefixHit, holder_codes, prefix_from_codes
from raykv.core.validate import ArgumentError, timeout_arg
from raykv.core.wire import HolderInfo, LookupReply
from raykv.directory.answers import AnswerStore
from raykv.directory.fingerprint import SMALL_BATCH, PackedKeys, fingerprints, packed_fingerprints, to_blob
from raykv.directory.messages import ShardStats
from raykv.directory.replaced import HEAL_EVERY_S, replace_in
from raykv.directory.round_trips import RoundTrips
from raykv.directory.shm_view import ViewReader
from raykv.directory.view_overlay import ViewOverlay
from raykv.metrics.step_cost import COUNTS

logger = logging.getLogger(__name__)
#: Lookups fail every step while the directory is down (``raykv stop``): one warning per 10 s.
_failures = Throttled(logger)


def shard_ids(keys: Sequence[bytes] | PackedKeys, num_shards: int) -> np.ndarray | None:
    """``shard_of`` of every key, vectorized; None unless every key is >= 12 bytes."""
    packed = keys if isinstance(keys, PackedKeys) else PackedKeys(keys)
    if not len(packed) or int(packed.lengths.min()) < 12:
        return None
    heads = np.ascontiguousarray(packed.bytes_at(12, 8)).view(">u8").reshape(-1)
    return heads % np.uint64(num_shards)


def fingerprints_and_shards(
    keys: Sequence[bytes], length: int | None, num_shards: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each key's fingerprint and owning shard, a batch at a time (keys bytes-like;
    all ``length`` bytes long when known)."""
    # Small batches go key by key: numpy's fixed costs are more than theirs.
    packed = PackedKeys(keys, length) if len(keys) >= SMALL_BATCH else None
    fps = fingerprints(keys) if packed is None else packed_fingerprints(packed)
    if num_shards == 1:
        return fps, np.zeros(len(keys), dtype=np.int64)
    ids = None if packed is None else shard_ids(packed, num_shards)
    if ids is None:  # a small batch, or keys shorter than 12 bytes
        ids = np.fromiter((shard_of(k, num_shards) for k in keys), dtype=np.int64, count=len(keys))
    return fps, ids


def _on_end(told: Callable[[BaseException | None], None]) -> Callable[[concurrent.futures.Future[Any]], None]:
    """A done-callback for a call's future that tells ``told`` its error (None: it succeeded)."""

    def callback(future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled():
            told(future.exception())

    return callback


class PendingLookup:
    """An in-flight batched lookup (one call per shard)."""

    def __init__(
        self,
        keys: list[bytes],
        parts: list[tuple[np.ndarray, ray.ObjectRef[LookupReply]]],
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.keys = keys
        self.parts = parts
        self.sent_at = time.monotonic()
        self._outcomes: list[CallOutcome] | None = None  # from the first ``done``
        self._on_error = on_error  # told of a reply's error before it is raised

    def _replies(self, timeout: float | None) -> list[LookupReply]:
        try:
            if self._outcomes is not None and all(o.finished for o in self._outcomes):
                return [o.value() for o in self._outcomes]  # ``done`` said so: no ray.get
            return ray.get([ref for _, ref in self.parts], timeout=timeout)
        except Exception as e:
            if self._on_error is not None:
                self._on_error(e)
            raise

    def done(self) -> bool:
        COUNTS.polls += 1
        return self.wait(0.0)

    def wait(self, timeout_s: float) -> bool:
        """Block at most ``timeout_s`` for every shard's reply; whether they all came."""
        if self._outcomes is None:
            self._outcomes = [CallOutcome(ref) for _, ref in self.parts]
        return wait_all(self._outcomes, timeout_s)

    def result(self, timeout: float | None = None) -> list[list[HolderInfo]]:
        """Holders of each key (empty list: nobody). Keys with the same holders
        share one list: treat the lists as read-only."""
        return self.decode(self._replies(timeout))

    async def result_async(self, timeout: float | None = None) -> list[list[HolderInfo]]:
        """``result`` awaited on an event loop (holder actors): never blocks it."""
        try:
            replies = await asyncio.wait_for(asyncio.gather(*(ref for _, ref in self.parts)), timeout)
        except Exception as e:
            if self._on_error is not None:
                self._on_error(e)
            raise
        return self.decode(replies)

    def _codes(self, replies: Sequence[LookupReply]) -> tuple[np.ndarray, np.ndarray]:
        if len(self.parts) == 1 and len(self.parts[0][0]) == len(self.keys):
            return holder_codes([(None, replies[0])], len(self.keys))  # one shard had every key, in order
        return holder_codes([(pos, r) for (pos, _), r in zip(self.parts, replies)], len(self.keys))

    def decode(self, replies: Sequence[LookupReply]) -> list[list[HolderInfo]]:
        """Per key its holders, from the shards' replies (in ``parts`` order)."""
        codes, by_code = self._codes(replies)
        return by_code[codes].tolist()

    def prefix(self, node_id: str | None, timeout: float | None = None) -> PrefixHit:
        """The leading keys held anywhere, each with its preferred holder."""
        codes, by_code = self._codes(self._replies(timeout))
        return prefix_from_codes(codes, by_code, node_id)


class DirectoryClient:
    """Talks to the ``num_shards`` directory shard actors of one namespace.

    Keys cross to the shards as one blob of fingerprints per call
    (``raykv.directory.fingerprint``), and answers come back as one blob of
    holder-set ids: no per-key object is pickled either way.
    """

    def __init__(self, shards: Sequence[ActorHandle], namespace: str | None = None) -> None:
        if not shards:
            raise ValueError("a directory needs at least one shard")
        self.shards = list(shards)
        #: Where to look for a shard started again under its name (None: never look).
        self.namespace = namespace
        self._healing_lock = threading.Lock()
        self._healing_until: dict[int, float] = {}  # shard -> no new lookup for it before (monotonic)

    def _heal_after(self, error: BaseException | None, indices: Sequence[int]) -> None:
        """A call to shards ``indices`` ended with ``error``: if one is dead for good, look for
        successors on a thread of its own (for each shard at most one lookup a second)."""
        if self.namespace is None or not isinstance(error, ActorDiedError):
            return
        now = time.monotonic()
        with self._healing_lock:
            due = [i for i in indices if now >= self._healing_until.get(i, 0.0)]
            for i in due:
                self._healing_until[i] = now + HEAL_EVERY_S
        if due:
            threading.Thread(target=self._replace_all, args=(due,), name="raykv-shard-heal", daemon=True).start()

    def _replace_all(self, indices: Sequence[int]) -> None:
        for i in indices:
            try:
                self.replace_dead(i)
            except Exception as e:  # the GCS unreachable: the next error tries again
                logger.debug("raykv: no successor found for directory shard %d: %r", i, e)

    def replace_dead(self, index: int) -> bool:
        """After ``ActorDiedError`` from shard ``index``: call the actor named for it now, if that
        is another one (``raykv.directory.replaced``). Blocking: call it off an event loop."""
        return self.namespace is not None and replace_in(self.shards, self.namespace, index)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def _split(self, keys: Sequence[bytes], length: int | None = None) -> list[tuple[np.ndarray, bytes]]:
        """Per shard: the positions of its keys in ``keys`` (bytes-like; all
        ``length`` bytes long when known), and their fingerprints' blob."""
        n = len(self.shards)
        fps, ids = fingerprints_and_shards(keys, length, n)
        if n == 1:
            return [(np.arange(len(keys)), to_blob(fps))]
        ids = ids.astype(np.int64, copy=False)
        order = np.argsort(ids, kind="stable")
        bounds = np.cumsum(np.bincount(ids, minlength=n))
        out = []
        for s in range(n):
            pos = order[(bounds[s - 1] if s else 0) : bounds[s]]
            out.append((pos, to_blob(fps[pos])))
        return out

    # -- holders ---------------------------------------------------------
    def add_holder(self, info: HolderInfo, handle: ActorHandle) -> list[ray.ObjectRef[None]]:
        """Announce a holder (and its actor, which every shard watches)."""
        return [s.add_holder.remote(info, handle) for s in self.shards]

    def remove_holder(self, holder_id: str, reason: str = "removed") -> list[ray.ObjectRef[int]]:
        return [s.remove_holder.remote(holder_id, reason) for s in self.shards]

    # -- keys --------------------------------------------------------------
    def register(self, holder_id: str, keys: Sequence[bytes]) -> list[ray.ObjectRef[int]]:
        return [
            self.shards[i].register.remote(holder_id, blob)
            for i, (pos, blob) in enumerate(self._split(keys))
            if len(pos)
        ]

    def claim(self, holder_id: str, key: bytes) -> ray.ObjectRef[int]:
        """Register ``key`` for ``holder_id`` at its shard, straight (no agent window);
        the answer: how many other holders listed it first (``DirectoryShardImpl.claim``)."""
        fps, shards = fingerprints_and_shards([key], len(key), len(self.shards))
        index = int(shards[0])
        ref: ray.ObjectRef[int] = self.shards[index].claim.remote(holder_id, to_blob(fps))
        if self.namespace is not None:
            ref.future().add_done_callback(_on_end(lambda e: self._heal_after(e, [index])))
        return ref

    def unregister(self, holder_id: str, keys: Sequence[bytes]) -> list[ray.ObjectRef[int]]:
        return [
            self.shards[i].unregister.remote(holder_id, blob)
            for i, (pos, blob) in enumerate(self._split(keys))
            if len(pos)
        ]

    def lookup_async(self, keys: Sequence[bytes]) -> PendingLookup:
        return self._lookup_bytes(*bytes_and_length(keys))

    def _lookup_bytes(self, keys: list[bytes], length: int | None) -> PendingLookup:
        """``lookup_async`` of keys known to be a list of ``bytes`` (all ``length`` long when known)."""
        asked: list[int] = []
        parts: list[tuple[np.ndarray, ray.ObjectRef[LookupReply]]] = []
        for i, (pos, blob) in enumerate(self._split(keys, length)):
            if len(pos):
                asked.append(i)
                parts.append((pos, self.shards[i].lookup.remote(blob)))
        if self.namespace is None:
            return PendingLookup(keys, parts)
        return PendingLookup(keys, parts, lambda e: self._heal_after(e, asked))

    def lookup(self, keys: Sequence[bytes], timeout: float | None = 30.0) -> list[list[HolderInfo]]:
        """Blocking lookup (tools and tests; engines use ``LookupCache``).

        ``keys`` must be a sequence of offload keys (``ArgumentError`` naming
        the first bad one); ``timeout`` seconds, or None to wait forever.
        """
        return self._lookup_bytes(*checked_keys(keys)).result(timeout_arg("timeout", timeout))

    def prefix_lookup(
        self, keys: Sequence[bytes], node_id: str | None = None, timeout: float | None = 30.0
    ) -> PrefixHit:
        """Leading keys held anywhere, each with its preferred holder:
        this node's plasma, then shared storage, then another node's plasma."""
        if node_id is not None and not isinstance(node_id, str):
            raise ArgumentError("node_id", f"must be a Ray node id (str) or None, got {type(node_id).__name__}")
        return self._lookup_bytes(*checked_keys(keys)).prefix(node_id, timeout_arg("timeout", timeout))

    def holder_fingerprints(self, holder_id: str, timeout: float | None = 30.0) -> set[int]:
        """Fingerprints of every key the directory lists for ``holder_id`` (tools, tests)."""
        parts: list[np.ndarray] = ray.get(
            [s.holder_fingerprints.remote(holder_id) for s in self.shards], timeout=timeout
        )
        return set(np.concatenate(parts).tolist()) if parts else set()

    def stats(self, timeout: float | None = 30.0) -> list[ShardStats]:
        """Each shard's ``ShardStats``, in shard order."""
        return ray.get([s.stats.remote() for s in self.shards], timeout=timeout)


class AgentClient:
    """The directory through the node's agent (``raykv.directory.agent``): an
    engine's lookups and a holder's registrations, one call each, merged there
    with the node's other calls into one call per shard per window."""

    def __init__(
        self, agent: ActorHandle, num_shards: int, restart: Callable[[], ActorHandle | None] | None = None
    ) -> None:
        self.agent = agent
        self.num_shards = num_shards
        #: Returns the node's agent, starting it when missing (``start_agent``), or None while
        #: raykv is stopped (``replaced.while_running``); None: never look.
        self._restart = restart
        self._healing_lock = threading.Lock()
        self._next_heal = 0.0  # monotonic: no new look for a successor before

    def _heal_after(self, error: BaseException | None) -> None:
        """A call to the agent ended with ``error``: if the agent is dead for good (killed
        without restart), have it started again and call the new one, on a thread of its
        own (at most once a second). Meanwhile calls fail: lookups miss, and a holder's
        registrations come back with its reconcile round."""
        if self._restart is None or not isinstance(error, ActorDiedError):
            return
        now = time.monotonic()
        with self._healing_lock:
            if now < self._next_heal:
                return
            self._next_heal = now + HEAL_EVERY_S
        threading.Thread(target=self._take_successor, name="raykv-agent-heal", daemon=True).start()

    def _take_successor(self) -> None:
        assert self._restart is not None
        try:
            new = self._restart()
        except Exception as e:  # the GCS unreachable, or the node going: the next error tries again
            logger.debug("raykv: the node's directory agent could not be started again: %r", e)
            return
        if new is not None and new != self.agent:
            self.agent = new
            logger.info("raykv: the node's directory agent was started again as a new actor: calling it now")

    def _watched(self, ref: ray.ObjectRef[int]) -> list[ray.ObjectRef[int]]:
        if self._restart is not None:
            ref.future().add_done_callback(_on_end(self._heal_after))
        return [ref]

    def _blobs(self, keys: Sequence[bytes]) -> tuple[list[bytes], bytes, bytes]:
        listed, length = bytes_and_length(keys)
        fps, shards = fingerprints_and_shards(listed, length, self.num_shards)
        return listed, to_blob(fps), shards.astype("<u2").tobytes()

    def register(self, holder_id: str, keys: Sequence[bytes]) -> list[ray.ObjectRef[int]]:
        """A holder of this node now holds ``keys`` (merged into the agent's next window)."""
        _, fps, shards = self._blobs(keys)
        return self._watched(self.agent.register.remote(holder_id, fps, shards))

    def unregister(self, holder_id: str, keys: Sequence[bytes]) -> list[ray.ObjectRef[int]]:
        _, fps, shards = self._blobs(keys)
        return self._watched(self.agent.unregister.remote(holder_id, fps, shards))

    def lookup_async(self, keys: Sequence[bytes]) -> PendingLookup:
        listed, length = bytes_and_length(keys)
        fps, shards = fingerprints_and_shards(listed, length, self.num_shards)
        ref: ray.ObjectRef[LookupReply] = self.agent.lookup.remote(to_blob(fps), shards.astype("<u2").tobytes())
        return PendingLookup(listed, [(np.arange(len(listed)), ref)], self._heal_after)


def _take_oldest(queued: dict[bytes, None], n: int) -> list[bytes]:
    """Remove and return the ``n`` oldest keys of ``queued`` (all of them when fewer)."""
    if n >= len(queued):
        keys = list(queued)
        queued.clear()
        return keys
    keys = list(itertools.islice(queued, max(0, n)))
    for k in keys:
        del queued[k]
    return keys


class LookupCache:
    """Non-blocking per-key directory answers for one engine process.

    ``get`` returns the holders of a key when a fresh answer is known, else
    None; ``request`` queues the key; ``flush`` sends all queued keys as one
    batched lookup; ``poll`` absorbs finished lookups. An answer that does not
    come within ``max_wait_s`` counts as "nobody holds it" (a miss is safe).

    Memory is bounded: at most ``max_entries`` answers are kept (least recently used ones go first;
    a dropped answer costs a RETRY and one more lookup, never a wrong answer), at most ``max_entries``
    keys wait for the next ``flush``, and at most ``max_entries`` are in flight (a slow directory's
    keys wait in the queue; in-flight keys leave when their lookup answers or times out).
    """

    def __init__(
        self,
        client: DirectoryClient | AgentClient,
        ttl_s: float = 2.0,
        max_wait_s: float = 5.0,
        max_entries: int = 131_072,
        view: ViewReader | None = None,
    ) -> None:
        self.client = client
        #: The node's directory view in shared memory (None: no agent): read first, no call.
        self.view = view
        #: This process's corrections to the view (its own stores, distrusted keys).
        self._overlay = ViewOverlay(view, ttl_s, max_entries) if view is not None else None
        self.max_wait_s = max_wait_s
        self._lock = threading.Lock()
        #: Answers kept (every use holds ``_lock``).
        self._answers = AnswerStore(ttl_s, max_entries)
        self.max_entries = max_entries
        self._queued: dict[bytes, None] = {}
        self._in_flight: dict[bytes, PendingLookup] = {}
        self._pending: list[PendingLookup] = []
        self.lookups_sent = 0
        #: The round trips of the lookups this process waited for (``RoundTrips.wait_budget``).
        self.round_trips = RoundTrips()
        self._timed: dict[int, float] = {}  # waited-for lookups answering late: id -> last seen unanswered
        #: Lookup rounds: one per engine step that looked anything up (the first ``flush`` after a
        #: ``poll``). A request RETRY'd in two rounds in a row is still held back (``lookup_retry_budget_ms``).
        self.round = 0
        self._looked = False

    def __len__(self) -> int:
        """Answers kept now (at most ``max_entries``)."""
        return len(self._answers)

    @property
    def ttl_s(self) -> float:
        """How long an answer is trusted."""
        return self._answers.ttl_s

    @property
    def evicted(self) -> int:
        """Answers dropped to stay within ``max_entries``."""
        return self._answers.evicted

    def sizes(self) -> dict[str, int]:
        """Entries per structure: answers, queued keys, in-flight keys, pending lookups."""
        with self._lock:
            return {
                "answers": len(self._answers),
                "queued": len(self._queued),
                "in_flight": len(self._in_flight),
                "pending": len(self._pending),
            }

    def get(self, key: bytes) -> list[HolderInfo] | None:
        """The holders of ``key`` when a fresh answer is known (the node's view
        first, then this process's answers), else None."""
        with self._lock:
            if self._overlay is not None:
                holders = self._overlay.get(key)
                if holders is not None:
                    return holders
            return self._answers.get(key)  # no view, a key it does not know, or one distrusted

    def request(self, key: bytes) -> None:
        with self._lock:
            if key not in self._in_flight:
                self._queued[key] = None
                if len(self._queued) > self.max_entries:  # asked again on its next lookup
                    del self._queued[next(iter(self._queued))]

    def has_pending(self) -> bool:
        """Whether keys wait to be sent or a sent lookup's answer has not come back
        (answers that came back are taken in: an idle engine stops stepping then)."""
        if self._pending and not self._queued:
            self._absorb()
        return bool(self._queued or self._pending)

    def flush(self) -> None:
        """Send queued keys in one batched lookup (one call per shard), up to ``max_entries`` in flight."""
        if self._looked:
            self._looked = False
            self.round += 1
        if self._pending and len(self._in_flight) + len(self._queued) > self.max_entries:
            self._absorb()  # answers (or time-outs) that came back make room first
        with self._lock:  # (none when full: the directory is behind; keys wait for answers)
            keys = _take_oldest(self._queued, self.max_entries - len(self._in_flight))
            if not keys:
                return
        try:
            pending = self._send(keys)
        except Exception as e:  # directory unreachable: answer "nobody"
            _failures.warning("directory lookup failed to send: %r", e)
            self._answer(keys, [[] for _ in keys])
            return
        with self._lock:
            self._pending.append(pending)

    def _send(self, keys: Sequence[bytes]) -> PendingLookup:
        """Send one batched lookup of ``keys``. They are in flight from the moment it
        leaves: a store of ours noted before its answer lands joins that answer
        (``note_stored``), whichever thread notes it."""
        with self._lock:
            pending = self.client.lookup_async(keys)
            self.lookups_sent += 1
            for k in keys:
                self._in_flight[k] = pending
        return pending

    def _settle(self, pending: PendingLookup, answers: Sequence[list[HolderInfo]]) -> None:
        """Cache ``pending``'s answers, then let its keys leave flight (in that order: a
        store noted in between finds either the key in flight or its answer)."""
        self._answer(pending.keys, answers)
        with self._lock:
            self._pending = [p for p in self._pending if p is not pending]
            self._timed.pop(id(pending), None)
            for k in pending.keys:
                if self._in_flight.get(k) is pending:
                    del self._in_flight[k]

    def poll(self) -> None:
        """Absorb finished lookups without blocking (tiers call it at each lookup)."""
        self._looked = True
        self._absorb()

    def _absorb(self) -> None:
        """Take in the answers of finished (or timed-out) lookups, without blocking."""
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            try:
                if p.done():
                    if id(p) in self._timed:  # a wait that timed out: its round trip is at least this
                        self.round_trips.observe(self._timed[id(p)] - p.sent_at)  # (not the idle time since)
                    answers = p.result(timeout=0)
                elif time.monotonic() - p.sent_at > self.max_wait_s:
                    _failures.warning("directory lookup of %d keys timed out", len(p.keys))
                    answers = [[] for _ in p.keys]
                else:
                    if id(p) in self._timed:
                        self._timed[id(p)] = time.monotonic()
                    continue
            except Exception as e:  # a shard died mid-lookup: treat as misses
                _failures.warning("directory lookup failed: %r", e)
                answers = [[] for _ in p.keys]
            self._settle(p, answers)

    def _answer(self, keys: Sequence[bytes], answers: Sequence[list[HolderInfo]]) -> None:
        with self._lock:
            self._answers.put(keys, answers)

    def resolve(self, keys: Sequence[bytes], timeout_s: float, unanswered: Callable[[str], None] | None = None) -> bool:
        """Look ``keys`` up now, in one batched call, and wait at most
        ``timeout_s`` for the answer (a request's whole prefix at its first
        lookup: its HITs and MISSes are then known in the step that asked).
        True when answered in time; otherwise the answer lands later, as for
        ``request`` + ``flush``. Where the node's view leaves keys to ask for,
        ``unanswered`` is told why (``raykv.directory.view_overlay.UNANSWERED``)."""
        why = None
        with self._lock:
            unknown = [k for k in dict.fromkeys(keys) if k not in self._answers and k not in self._in_flight]
            if unknown and self._overlay is not None:
                answered = self._overlay.read_prefix(unknown)
                unknown = [k for k in unknown if k not in answered]
                why = self._overlay.unanswered
            full = len(self._in_flight) + len(unknown) > self.max_entries
        if why is not None and unanswered is not None:
            unanswered(why)
        if not unknown:
            return True
        if full:  # the directory is behind: the keys go with the step's batched call as room frees
            return False
        try:
            pending = self._send(unknown)
        except Exception as e:  # directory unreachable: answer "nobody"
            _failures.warning("directory lookup failed to send: %r", e)
            self._answer(unknown, [[] for _ in unknown])
            return True
        t0 = time.perf_counter_ns()
        came = pending.wait(timeout_s)
        if timeout_s > 0:
            COUNTS.waits += 1
            COUNTS.wait_ns += time.perf_counter_ns() - t0
        else:
            COUNTS.polls += 1
        if came:
            if timeout_s > 0:
                self.round_trips.observe(time.monotonic() - pending.sent_at)
            try:
                answers = pending.result(timeout=0)
            except Exception as e:  # a shard died mid-lookup: treat as misses
                _failures.warning("directory lookup failed: %r", e)
                answers = [[] for _ in unknown]
            self._settle(pending, answers)
            return True
        with self._lock:  # not in time: ``poll`` absorbs it later
            if timeout_s > 0:
                self._timed[id(pending)] = time.monotonic()
            self._pending.append(pending)
        return False

    def wait(self, timeout: float = 10.0) -> None:
        """Flush and block until every queued key is answered (tools and tests)."""
        self.flush()
        deadline = time.monotonic() + timeout
        while self.has_pending() and time.monotonic() < deadline:
            self.poll()
            if self.has_pending():
                time.sleep(0.001)

    def note_stored(self, keys: Sequence[bytes], holder: HolderInfo) -> None:
        """Record that ``holder`` now holds ``keys`` (our own stores).

        Only keys with a cached answer are updated: for the others we do not
        know who else holds them, and an entry naming ``holder`` alone would
        make other tiers of this process answer MISS for blocks they hold.
        """
        with self._lock:
            for k in keys:
                if not self._answers.add_holder(k, holder) and k in self._in_flight:
                    # Its lookup was sent before this store registered: the answer on
                    # its way may not name ``holder``; the store adds it then.
                    self._answers.hold_for_answer(k, holder)
            if self._overlay is not None:  # read our writes until the view shows them
                self._overlay.note_stored(keys, holder)

    def invalidate(self, keys: Sequence[bytes], tier_type: str | None = None) -> None:
        """Forget cached answers for ``keys``: only their ``tier_type`` holders
        when given (the other tiers' holders stay known), else all of them. The
        node's view is not trusted for them for ``ttl_s`` either (a failed load
        says it may lag): they are asked again."""
        with self._lock:
            for k in keys:
                self._answers.invalidate(k, tier_type)
            if self._overlay is not None:  # the view may be as wrong: not trusted for these for a while
                self._overlay.distrust(keys, tier_type)
