"""Compute once: an engine process's pending entries and its wait-or-compute rule.

A request whose prefix nobody holds is computed by the engine that got it.
``PendingBook.announce`` lists those blocks in the directory as *pending*
(``raykv.holders.pending``), with a deadline; ``stored`` ends each entry when
the block's store succeeds, and ``ended`` those its request ends without handing
a store for (a client that hung up, an aborted request) or whose store failed.
Another engine whose lookup meets a pending entry asks ``decide`` how long to
wait (answering RETRY until the blocks register, then loading them) or whether
to compute them anyway.

The rule uses what this process measured:

- ``compute_s_per_block``: from announcing a request's blocks to their stores
  succeeding, per block (the time a waiter waits for another engine's copy);
- ``load_s_per_block``: how long this process's loads take, per block.

Wait when loading is cheaper than computing (or either is not measured yet),
for at most ``WAIT_FACTOR`` x the request's own compute estimate plus
``WAIT_SLACK_S`` (the other engine began earlier, so its copy is due sooner
than ours would be), never longer than ``pending_max_wait_ms``. A wait that
ends without the blocks computes them; it is counted (``gave_up``).

Two engines that get the same new prefix at the same moment both find nobody
computing it and both announce. So an announcement also *claims* its first
block at the block's shard, straight (``DirectoryShard.claim``: register, and
say who listed it before), and the request holds back (RETRY) until the answer
comes, for at most ``claim_budget_s`` (counted ``claim``). The shard serialises
claims: one engine is first and computes; the others withdraw their entries
and wait for its copy (counted ``yield``).

Only blocks whose prefill takes at least 40 of this process's claims' round
trips are listed and claimed (``listing_pays``). Fewer (a chat turn's new part)
are computed as without pending entries (counted ``short``): holding back for
the claim (about two round trips: it ends at a step) would cost the request
more than a twentieth of its prefill, and listing them costs the directory
more than a burst could save. Both numbers
are lower medians of this process's latest ``SAMPLES`` measurements: the
prefill (``prefill_s_per_block``) timed from the request's release (its claim
answered) to the job that hands its computed blocks to the tier, and a claim's
round trip. An engine's start-up and its queues, which the compute estimate
above carries, would list every chat turn; a burst's slow round trips would
stop listing the burst's prefix.

Everything here is bookkeeping in this process: no call waits.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import ModuleType
from typing import cast

import ray
from ray.actor import ActorClass, ActorHandle

from raykv.core.contract import LookupResult, ReqContext
from raykv.core.keys import pending_key
from raykv.core.naming import OWNER_ENV
from raykv.core.wire import PENDING, HolderInfo
from raykv.directory.client import DirectoryClient, LookupCache
from raykv.engine.announced import AnnouncedBlocks
from raykv.engine.idle_steps import IdleSteps
from raykv.holders import pending as pending_holder
from raykv.metrics.catalog import record
from raykv.services.cluster import RaykvServices

logger = logging.getLogger(__name__)

#: A waiter waits at most this many times its own compute estimate for the blocks...
WAIT_FACTOR = 1.5
#: ...plus this (the other engine's store, its registration, the feed to this node).
WAIT_SLACK_S = 0.25
#: How long a waiter still waits for a block whose pending entry ended without it in view:
#: its registration travels through another shard's feed (replica lag p99 under 0.1 s).
REGISTER_GRACE_S = 0.5
#: How many of a request's next blocks a lookup checks for other engines' pending entries.
SCAN_BLOCKS = 64
#: An announcement's deadline: this many times the compute estimate plus ``WAIT_SLACK_S``.
DEADLINE_FACTOR = 2.0
#: A request may wait this share of its own compute time for the directory's answers (at
#: least ``lookup_retry_budget_ms``): a long prefill can afford to learn who computes it already.
ANSWER_SHARE = 0.1
#: A request holds back for its claim's answer at most this share of its compute time, and
#: at least ``MIN_CLAIM_S``: the answer is one round trip to a shard (milliseconds), but
#: 50-200 ms on a loaded host, where a shorter budget computed every burst on every replica.
CLAIM_SHARE = 0.25
MIN_CLAIM_S = 0.1
#: A request lists the blocks it computes (and claims them) only when a claim's round trip
#: is at most this share of their prefill time. Holding back for the claim costs about two
#: round trips (it ends at the step after the answer: 17-45 ms for answers of 7-31 ms on a
#: loaded 2-core host), so about a twentieth of the prefill. Listing also costs the
#: directory a registration, an end and a change in every node's view per request, while
#: only a request whose prefix another engine gets at the same time gains. Blocks that
#: prefill in less than 40 round trips (a chat turn's new part) are computed as without
#: pending entries (counted ``short``); a long new prefix (a fork's context, a new
#: document) is listed and claimed.
LISTING_PAYS_SHARE = 0.025
#: How many of the latest measurements the prefill and round-trip estimates are the lower median of.
SAMPLES = 15
#: Weight of the newest sample in the running estimates.
EWMA = 0.3
#: What the decisions are counted as (``raykv_pending_decisions``).
DECISIONS = ("announce", "claim", "short", "wait", "compute", "loaded", "gave_up", "yield", "dropped")


class PendingBook:
    """One engine process's pending entries (one ``PendingActor``) and its wait rule."""

    def __init__(
        self,
        namespace: str,
        node_id: str,
        max_wait_s: float,
        owner: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_actor: bool = True,
        directory: DirectoryClient | None = None,
    ) -> None:
        self.namespace = namespace
        self.node_id = node_id
        self.max_wait_s = max_wait_s
        self.info: HolderInfo = pending_holder.holder_info(namespace, node_id, owner or os.environ.get(OWNER_ENV))
        self._clock = clock
        self._start_actor = start_actor
        self._directory = directory
        self._actor: ActorHandle | None = None
        self._lock = threading.Lock()
        #: pending key -> what the book remembers of its announcement
        self.announced = AnnouncedBlocks()
        self.compute_s_per_block: float | None = None
        #: The prefill alone, per block (``SAMPLES``; None: not measured yet).
        self._prefill = LowerMedian(SAMPLES)
        self.load_s_per_block: float | None = None
        #: How long this process's claims take to be answered (``SAMPLES``; None: none yet).
        self._claim_rtt = LowerMedian(SAMPLES)
        self.counts: dict[str, int] = dict.fromkeys(DECISIONS, 0)
        self._unflushed: dict[str, int] = dict.fromkeys(DECISIONS, 0)
        #: The process's live requests and those held back this step: a CPU engine's idle steps pause.
        self.idle = IdleSteps(_cpu_engine)

    # -- the rule ------------------------------------------------------------
    def decide(self, blocks: int) -> float:
        """Seconds a request should wait for ``blocks`` blocks another engine is
        computing (0: compute them). Counted as ``wait`` or ``compute``."""
        compute = None if self.compute_s_per_block is None else self.compute_s_per_block * blocks
        load = None if self.load_s_per_block is None else self.load_s_per_block * blocks
        if compute is not None and load is not None and load >= compute:
            self.count("compute")
            return 0.0
        wait = self.max_wait_s if compute is None else min(self.max_wait_s, WAIT_FACTOR * compute + WAIT_SLACK_S)
        self.count("wait" if wait > 0 else "compute")
        return wait

    def answer_budget_s(self, blocks: int) -> float:
        """How long a request of ``blocks`` blocks may wait for the directory's answers
        before computing them: ``ANSWER_SHARE`` of its measured compute time (0: not measured)."""
        return 0.0 if self.compute_s_per_block is None else ANSWER_SHARE * self.compute_s_per_block * blocks

    def claim_budget_s(self, blocks: int) -> float:
        """How long a request that announced ``blocks`` blocks may hold back for its
        claim's answer: ``CLAIM_SHARE`` of their compute time, at least ``MIN_CLAIM_S``."""
        compute = 0.0 if self.compute_s_per_block is None else self.compute_s_per_block * blocks
        return min(self.max_wait_s, max(MIN_CLAIM_S, CLAIM_SHARE * compute))

    def listing_pays(self, blocks: int) -> bool:
        """Whether a request that computes ``blocks`` blocks should list them as pending
        and claim them: yes until both their prefill time and a claim's round trip are
        measured, then only while the round trip is at most ``LISTING_PAYS_SHARE`` of the
        blocks' prefill time."""
        if self.prefill_s_per_block is None or self.claim_rtt_s is None:
            return True
        return self.claim_rtt_s <= LISTING_PAYS_SHARE * self.prefill_s_per_block * blocks

    def observe_claim(self, seconds: float) -> None:
        """One claim answered ``seconds`` after it was sent."""
        if seconds >= 0:
            with self._lock:
                self._claim_rtt.add(seconds)

    @property
    def prefill_s_per_block(self) -> float | None:
        """This process's prefill time per block (None: not measured yet)."""
        return self._prefill.value

    @property
    def claim_rtt_s(self) -> float | None:
        """How long this process's claims take to be answered (None: none answered yet)."""
        return self._claim_rtt.value

    def deadline_s(self, blocks: int) -> float:
        """How long an announcement of ``blocks`` blocks stays listed at most."""
        if self.compute_s_per_block is None:
            return self.max_wait_s
        return min(self.max_wait_s, DEADLINE_FACTOR * self.compute_s_per_block * blocks + WAIT_SLACK_S)

    def others_compute(self, holders: Sequence[HolderInfo] | None) -> bool:
        """Whether ``holders`` (a pending key's; None: not known) name another engine than this process computing it."""
        return any(h.medium == PENDING and h.holder_id != self.info.holder_id for h in holders or ())

    # -- the entries -----------------------------------------------------------
    def announce(self, keys: Sequence[bytes], listed: bool = True) -> None:
        """This process computes the blocks of ``keys`` (scoped tier keys, in prefix order)
        now: listed as pending in the directory, or (not ``listed``) only timed here for
        the compute estimate (counted ``short``)."""
        if not keys:
            return
        pks = [pending_key(k) for k in keys]
        with self._lock:
            forgotten = self.announced.add(pks, self._clock(), listed)
        self.count("announce" if listed else "short")
        actor = self._handle() if listed or forgotten else None
        if actor is not None:
            if forgotten:
                actor.drop.remote(forgotten)
            if listed:
                actor.announce.remote(pks, self.deadline_s(len(pks)))

    def released(self, keys: Sequence[bytes]) -> None:
        """The request that announced ``keys`` (scoped tier keys) stops holding back for
        its claim and computes them now: their prefill is timed from here."""
        now = self._clock()
        with self._lock:
            self.announced.release([pending_key(k) for k in keys], now)

    def stored(self, keys: Sequence[bytes], submitted: float | None = None) -> None:
        """Blocks of ``keys`` (scoped tier keys) stored, handed to the tier at ``submitted``
        (monotonic s; None: not known): their entries end, the time since their
        announcement updates the compute estimate, and the time from their request's
        release to ``submitted`` the prefill estimate."""
        now = self._clock()
        done: list[bytes] = []
        per_block: list[float] = []
        prefill: list[float] = []
        with self._lock:
            for k in keys:
                pk = pending_key(k)
                seen = self.announced.pop(pk)
                if seen is not None:
                    per_block.append((now - seen.announced) / seen.place)
                    if submitted is not None and submitted > seen.released:
                        prefill.append((submitted - seen.released) / seen.place)
                    if seen.listed:
                        done.append(pk)
            if prefill:
                # the block announced last in a store's batch is the one its request waited longest for
                self._prefill.add(min(prefill))
        if not per_block:
            return
        self.compute_s_per_block = _ewma(self.compute_s_per_block, min(per_block))
        actor = self._handle()
        if actor is not None and done:
            actor.finish.remote(done)

    def storing(self, keys: Sequence[bytes], change: int = 1) -> None:
        """A tier of this process got a store of ``keys`` (scoped): their entries outlive
        their request. ``change=-1``: that store failed; vLLM hands a block's store to a
        tier once, so a block with no other store in flight ends its entry now (``ended``)."""
        with self._lock:
            self.announced.storing([pending_key(k) for k in keys], change)
        if change < 0:
            self.ended(keys, "a failed store", request=False)

    def ended(self, keys: Sequence[bytes], why: str = "a request", request: bool = True) -> int:
        """The ``request`` that listed ``keys`` (scoped; ``why``: who, for the log) ended: vLLM says so only once no
        store can be handed to a tier for it. Unless another live request of this process lists them, the entries of
        blocks it handed no store for end now (``dropped``): waiters compute. Not ``request``: a store failed."""
        gone = self._end(keys, request)
        if gone:
            self.count("dropped")
            logger.debug("raykv: %s leaves %d listed blocks unstored: their entries end", why, len(gone))
        return len(gone)

    def untimed(self, keys: Sequence[bytes]) -> None:
        """The request that computed ``keys`` (scoped) unlisted (``short``) ended: blocks
        no store in flight, other request or listing keeps are forgotten, untimed."""
        with self._lock:
            self.announced.untime([pending_key(k) for k in keys])

    def _end(self, keys: Sequence[bytes], request: bool) -> list[bytes]:
        """End the entries of ``keys`` (scoped) kept by no store in flight and no other lister (``ended``)."""
        with self._lock:
            gone = self.announced.end([pending_key(k) for k in keys], request)
        if gone and (actor := self._handle()) is not None:
            actor.drop.remote(gone)
        return gone

    def claim(self, key: bytes) -> Future[int] | None:
        """Claim the block of ``key`` (a scoped tier key this process announced) at its
        shard: the answer is how many engines claimed it first (None: cannot ask)."""
        if self._directory is None or self._handle() is None:
            return None
        try:
            answer = self._directory.claim(self.info.holder_id, pending_key(key)).future()
        except Exception as e:  # noqa: BLE001 - without an answer the request computes
            logger.debug("raykv: claim not sent: %r", e)
            return None
        sent = time.monotonic()
        answer.add_done_callback(lambda _: self.observe_claim(time.monotonic() - sent))
        return answer

    def withdraw(self, keys: Sequence[bytes]) -> None:
        """The request that listed ``keys`` (scoped) will not compute them after all: another
        engine claimed them first. Their entries end as at its end (``ended``), untimed."""
        self.count("yield")
        self._end(keys, request=True)

    def observe_load(self, seconds: float, blocks: int) -> None:
        """One of this process's loads: ``blocks`` blocks in ``seconds``."""
        if blocks > 0 and seconds >= 0:
            self.load_s_per_block = _ewma(self.load_s_per_block, seconds / blocks)

    # -- counts ----------------------------------------------------------------
    def count(self, decision: str, n: int = 1) -> None:
        with self._lock:
            self.counts[decision] += n
            self._unflushed[decision] += n

    def flush(self) -> None:
        """Hand the decisions counted since the last flush to Ray (no remote call)."""
        with self._lock:
            deltas = {d: n for d, n in self._unflushed.items() if n}
            self._unflushed = dict.fromkeys(DECISIONS, 0)
        for decision, n in deltas.items():
            record("raykv_pending_decisions", n, {"node": self.node_id, "decision": decision})

    # -- the actor -------------------------------------------------------------
    def start(self) -> None:
        """Start the process's ``PendingActor`` without waiting for it."""
        self._handle()

    def _handle(self) -> ActorHandle | None:
        """The process's ``PendingActor``, started on first use without waiting for
        it (calls queue until it runs); None when it cannot be started."""
        if self._actor is not None or not self._start_actor:
            return self._actor
        with self._lock:
            if self._actor is None:
                try:
                    self._actor = _start(self.info, self.namespace)
                except Exception as e:  # entries are an optimisation: computing stays correct
                    logger.warning("raykv: pending entries unavailable on this engine: %r", e)
                    self._start_actor = False
        return self._actor


def request_blocks(req_context: ReqContext) -> int:
    """Blocks of the request's prompt, as the engine lists them (1 when it does not say)."""
    if req_context.prefix_keys is None:
        return 1
    try:
        return max(1, len(req_context.prefix_keys()))
    except Exception:  # noqa: BLE001 - the engine's bookkeeping: an estimate only
        return 1


class ComputeOnce:
    """One tier's lookups under the compute-once rule, with its process's ``PendingBook``.

    A request whose block no tier of the process can load waits while another
    engine computes it (RETRY, for at most ``PendingBook.decide``'s time), else
    computes it and announces what it computes: the block and the request's
    later blocks nobody holds, once per request (the request's ``ReqContext``
    is shared by all tiers of the process)."""

    def __init__(
        self,
        book: PendingBook,
        answers: LookupCache,
        loadable: Callable[[list[HolderInfo]], bool],
        scoped_prefix: Callable[[ReqContext], list[bytes]],
    ) -> None:
        self.book = book
        self._answers = answers
        self._loadable = loadable
        self._scoped_prefix = scoped_prefix

    def lookup(
        self, key: bytes, holders: list[HolderInfo], result: LookupResult, req_context: ReqContext
    ) -> LookupResult:
        """The answer for ``key`` (scoped), whose holders are known, given the tier's own ``result``."""
        book = self.book
        if result is LookupResult.HIT:
            if req_context.pending_wait_until is not None and not req_context.pending_loaded:
                req_context.pending_loaded = True
                book.count("loaded")
                logger.debug("raykv: %s waited and loads %s", req_context.req_id, key.hex()[:16])
            return result
        if self._loadable(holders):
            return result  # another tier of this process loads it: not a miss of the process
        now = time.monotonic()
        if req_context.pending_announced:  # it computes them; first, whose claim came first
            if self._hold_claim(req_context, now):
                self.hold(req_context)
                return LookupResult.RETRY
            if req_context.pending_announced:
                return result
        if not req_context.pending_wait_ended:
            computing = self._computing(key, req_context)
            if req_context.pending_wait_until is None and computing:
                blocks = request_blocks(req_context)
                wait_s = book.decide(blocks)
                req_context.pending_wait_until = now + wait_s
                if wait_s > 0:
                    req_context.pending_wait_live_until = now + book.max_wait_s
                logger.debug(
                    "raykv: %s meets %d blocks another engine computes: %s (compute %s s/block, load %s s/block)",
                    req_context.req_id,
                    blocks,
                    f"waits up to {wait_s:.3f} s" if wait_s > 0 else "computes",
                    book.compute_s_per_block,
                    book.load_s_per_block,
                )
            until = req_context.pending_wait_until
            if until is not None and computing and now >= until:
                until = self._still_live(req_context, until, now)
            if until is not None and now < until:
                # An entry that just ended names a block whose registration may reach this
                # node's view a little later (another shard's feed): wait for it a moment.
                gone = req_context.pending_gone_at = None if computing else (req_context.pending_gone_at or now)
                if gone is None or now - gone < REGISTER_GRACE_S:
                    self.hold(req_context)
                    return LookupResult.RETRY
            if until is not None:  # the wait ran out, or the entry ended without the block
                book.count("gave_up")
                logger.debug(
                    "raykv: %s stopped waiting for %s (entry %s)",
                    req_context.req_id,
                    key.hex()[:16],
                    "gone" if not computing else "past its wait",
                )
            req_context.pending_wait_ended = True
        self.announce(key, req_context, claim=req_context.pending_wait_until is None)
        if self._hold_claim(req_context, now):
            self.hold(req_context)
            return LookupResult.RETRY
        return result

    @staticmethod
    def _still_live(req_context: ReqContext, until: float, now: float) -> float:
        """Past its own wait, a request whose blocks are still pending waits on while
        the entries live, up to ``pending_max_wait_ms`` from its wait's start (the
        entries' own deadline is at most that). The announcer is slower than this
        engine's estimate (it is loaded, or queued), but it started earlier: computing
        now would cost this request its whole compute time on top of the wait so far,
        while the copy is due once the announcer's remaining part is done. An announcer
        that dies ends its entries at once, so this never outlasts a crash."""
        live_until = req_context.pending_wait_live_until
        if live_until is None or now >= live_until:
            return until
        req_context.pending_wait_until = live_until  # from now on, an entry that ends gets the usual grace
        if not req_context.pending_wait_extended:
            req_context.pending_wait_extended = True
            logger.debug(
                "raykv: %s: past its own wait, the blocks are still pending: waits on, up to %.3f s more",
                req_context.req_id,
                live_until - now,
            )
        return live_until

    def unknown(self, key: bytes, req_context: ReqContext) -> bool:
        """``key``'s holders are not known yet and the request will not wait longer for
        them: it computes the blocks, announced and claimed like any (the claim goes
        straight to the shard, past a slow directory answer). True: hold back this step
        (RETRY) for the claim's answer, or, once another engine claimed them first,
        for that engine's copy."""
        now = time.monotonic()
        if not req_context.pending_announced and req_context.pending_wait_until is None:
            self.announce(key, req_context, claim=True)
        held = self._hold_claim(req_context, now) if req_context.pending_announced else self.waiting(req_context)
        if held:
            self.book.idle.held(req_context.req_id, req_context.pending_claim)  # the caller counts the RETRY
        return held

    def held_back(self, req_context: ReqContext) -> bool:
        """Whether the request announced blocks (its claim decides) or waits for another
        engine's copy: it is not held to the retry budget of a key whose answer is late."""
        return req_context.pending_announced or self.waiting(req_context)

    def hold(self, req_context: ReqContext) -> None:
        """The request is answered RETRY this step to wait for a copy or its claim: when
        every request of the engine is, the step's end pauses (``IdleSteps``)."""
        req_context.retries += 1
        self.book.idle.held(req_context.req_id, req_context.pending_claim)

    def finished(self, req_context: ReqContext) -> None:
        """The request ended (``on_request_finished``): entries of blocks it announced and
        handed no store for end now (``PendingBook.ended``; the first of its tiers told)."""
        self.book.idle.finished(req_context.req_id)
        keys, req_context.pending_keys = req_context.pending_keys, ()
        self.book.ended(keys, f"request {req_context.req_id}")
        timed, req_context.pending_timed_keys = req_context.pending_timed_keys, ()
        self.book.untimed(timed)

    @staticmethod
    def waiting(req_context: ReqContext) -> bool:
        """Whether the request waits for another engine's copy now."""
        until = req_context.pending_wait_until
        return until is not None and not req_context.pending_wait_ended and time.monotonic() < until

    def _hold_claim(self, req_context: ReqContext, now: float) -> bool:
        """Whether the request, which announced blocks, holds back another step: until
        its claim on the first of them is answered (at most its claim budget). When
        another engine claimed it first, the request withdraws its entries and waits
        for that engine's copy (``decide``). Otherwise it computes them from now
        (``PendingBook.released``)."""
        claim, until = req_context.pending_claim, req_context.pending_claim_until
        if claim is None or until is None:
            return False
        if not claim.done() and now < until:
            return True
        req_context.pending_claim = req_context.pending_claim_until = None
        book = self.book
        wait_s = self._claim_wait(req_context, claim)
        if wait_s <= 0:
            book.released(req_context.pending_keys)
            return False
        book.withdraw(req_context.pending_keys)
        req_context.pending_keys = ()
        req_context.pending_announced = False
        req_context.pending_wait_ended = False
        req_context.pending_wait_until = now + wait_s
        req_context.pending_wait_live_until = now + book.max_wait_s
        return True

    def _claim_wait(self, req_context: ReqContext, claim: Future[int]) -> float:
        """How long the request waits for another engine's copy, by its claim's answer
        (0: it computes its blocks: it was first, or the answer is missing or late)."""
        if not claim.done():
            logger.debug("raykv: %s: no answer to its claim in time: computes", req_context.req_id)
            return 0.0
        try:
            first = claim.result() <= 0  # (-1: its holder not known to the shard yet)
        except Exception as e:  # noqa: BLE001 - the shard is down: compute
            logger.debug("raykv: %s: claim failed: %r", req_context.req_id, e)
            return 0.0
        if first:
            return 0.0
        blocks = len(req_context.pending_keys)
        wait_s = self.book.decide(blocks)
        logger.debug(
            "raykv: %s: another engine claimed its %d blocks first: %s",
            req_context.req_id,
            blocks,
            f"waits up to {wait_s:.3f} s" if wait_s > 0 else "computes them too",
        )
        return wait_s

    def _computing(self, key: bytes, req_context: ReqContext) -> bool:
        """Whether another engine has ``key``, or one of the request's next blocks
        (up to ``SCAN_BLOCKS``), pending. The later ones count: an engine storing a
        prefix block by block ends ``key``'s entry before this node's view shows the
        block registered (another shard's feed), while the rest are still pending."""
        book, answers = self.book, self._answers
        if book.others_compute(answers.get(pending_key(key))):
            return True
        scoped = self._scoped_prefix(req_context)
        if key not in scoped:
            return False
        start = scoped.index(key) + 1
        return any(book.others_compute(answers.get(pending_key(k))) for k in scoped[start : start + SCAN_BLOCKS])

    def announce(self, key: bytes, req_context: ReqContext, claim: bool = False) -> None:
        """The request computes ``key``: list it and the request's later keys nobody
        holds (as far as this process knows) as pending, once per request, when they
        are enough to pay for it (``PendingBook.listing_pays``). With ``claim``, its
        lookups then hold back a little to see whether another engine announced them
        first (``_hold_claim``)."""
        if req_context.pending_announced:
            return
        keys = [key]
        scoped = self._scoped_prefix(req_context)
        if key in scoped:
            keys = [k for k in scoped[scoped.index(key) :] if not self._answers.get(k)]
        req_context.pending_announced = True
        if not self.book.listing_pays(len(keys)):
            self.book.announce(keys, listed=False)  # timed, for the estimates
            req_context.pending_timed_keys = tuple(keys)
            logger.debug(
                "raykv: %s computes %d blocks, too few to list (prefill %s s/block, a claim's round trip %s s)",
                req_context.req_id,
                len(keys),
                self.book.prefill_s_per_block,
                self.book.claim_rtt_s,
            )
            return
        logger.debug(
            "raykv: %s lists %d blocks as pending (prefill %s s/block, compute %s s/block, a claim's round trip %s s)",
            req_context.req_id,
            len(keys),
            self.book.prefill_s_per_block,
            self.book.compute_s_per_block,
            self.book.claim_rtt_s,
        )
        self.book.announce(keys)
        req_context.pending_keys = tuple(keys)
        if claim:
            answer = self.book.claim(keys[0])  # sent even when the request cannot hold back for it
            budget = self.book.claim_budget_s(len(keys))
            if req_context.retry_budget_s is not None:  # its own budget bounds its hold too
                budget = min(budget, req_context.retry_budget_s)
            if answer is not None and budget > 0:
                req_context.pending_claim, req_context.pending_claim_until = answer, time.monotonic() + budget
                self.book.count("claim")


#: One book per ``RaykvServices`` (a process attaches once per namespace and Ray session).
_books: weakref.WeakKeyDictionary[RaykvServices, PendingBook] = weakref.WeakKeyDictionary()
_books_lock = threading.Lock()


def pending_book(services: RaykvServices) -> PendingBook | None:
    """This process's ``PendingBook`` for ``services``' namespace (every tier of the
    process shares it); None when the namespace turned pending entries off
    (``pending_entries``, ``pending_max_wait_ms`` 0) or runs no directory agents:
    without a node's view, answers are cached for ``lookup_ttl_s`` and a waiter
    would not see the blocks register in time."""
    config = services.config
    max_wait_s = float(getattr(config, "pending_max_wait_ms", 0.0)) / 1000
    if (
        not getattr(config, "pending_entries", False)
        or not getattr(config, "directory_agent", False)
        or max_wait_s <= 0
    ):
        return None
    with _books_lock:
        book = _books.get(services)
        if book is None:
            book = _books[services] = PendingBook(
                services.namespace, services.node_id(), max_wait_s, directory=services.directory
            )
            book.start()  # now, not at the first announcement: the actor takes a second or so to start
        return book


def wait_started(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` until the ``PendingActor`` of each of this process's books runs. A deployment
    pays an actor's start once per engine (a worker process: about a CPU second); a
    benchmark's warm-up waits for it, so that a trace of a few seconds right after the
    engines start does not time it. True: every one runs (or the process has none)."""
    with _books_lock:
        actors = [book._actor for book in _books.values() if book._actor is not None]
    if not actors:
        return True
    probes: list[ray.ObjectRef[object]] = [actor.ready.remote() for actor in actors]
    done, _ = ray.wait(probes, num_returns=len(probes), timeout=timeout_s)
    return len(done) == len(probes)


def decisions_so_far(services: RaykvServices) -> dict[str, int]:
    """This process's compute-once decisions for ``services`` so far ({} when it has no book)."""
    with _books_lock:
        book = _books.get(services)
    if book is None:
        return {}
    with book._lock:
        return dict(book.counts)


def idle_so_far(services: RaykvServices) -> tuple[int, float]:
    """This process's idle steps paused for ``services`` so far, and the seconds slept (``IdleSteps``)."""
    with _books_lock:
        book = _books.get(services)
    return (0, 0.0) if book is None else (book.idle.idle_steps, book.idle.slept_s)


def _cpu_engine() -> bool:
    """Whether this engine process runs on CPU (no CUDA device). A process that has not
    imported torch is no CUDA engine, and importing it here (seconds) would stall the step."""
    torch = sys.modules.get("torch")
    return True if torch is None else _no_cuda(torch)


@functools.cache
def _no_cuda(torch: ModuleType) -> bool:
    return not torch.cuda.is_available()


class LowerMedian:
    """The lower median of the latest ``window`` samples: a few slow ones (a start-up,
    a queue) do not move it, and it follows the samples once most of them change."""

    def __init__(self, window: int) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self._samples.append(sample)
        ordered = sorted(self._samples)
        self.value = ordered[(len(ordered) - 1) // 2]

    def __len__(self) -> int:
        return len(self._samples)

    def set(self, value: float | None) -> None:
        """Forget the samples; ``value`` stands for them (None: not measured)."""
        self._samples.clear()
        if value is not None:
            self._samples.append(value)
        self.value = value


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA) * old + EWMA * sample


def _start(info: HolderInfo, namespace: str) -> ActorHandle:
    """Start the process's ``PendingActor`` on its node. Owned by this process
    (not detached): it dies with the engine, and its entries with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_class = cast("ActorClass[pending_holder.PendingActor]", pending_holder.PendingActor)
    actor = actor_class.options(
        name=info.actor_name,
        namespace=namespace,
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(str(info.node_id), soft=True),
    ).remote(info, namespace)
    assert isinstance(actor, ActorHandle)  # Ray's stubs also allow the class itself
    return actor
