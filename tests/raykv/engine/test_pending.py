"""Compute once (issue 25): an engine computing a prefix nobody holds lists it as
pending; another engine meeting it waits and loads instead of computing it too.

The rule itself runs without Ray (``PendingBook``, a fake clock). The rest runs
engine-side object-store tiers in separate processes (Ray actors: each is an
engine process with its own pending holder) on a real local Ray with the
node's directory agent."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import ray

import raykv
from raykv.core.contract import LookupResult, ReqContext
from raykv.core.identity import DEFAULT_IDENTITY, KVIdentity, scoped_keys
from raykv.core.keys import PENDING_GROUP, pending_key, prefix_keys
from raykv.core.wire import PENDING
from raykv.engine.pending import (
    CLAIM_SHARE,
    LISTING_PAYS_SHARE,
    MIN_CLAIM_S,
    WAIT_FACTOR,
    WAIT_SLACK_S,
    PendingBook,
    _books,
    pending_book,
    wait_started,
)
from tests.waiting import wait_until

BLOCK = 4096


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _book(max_wait_s: float = 5.0) -> tuple[PendingBook, _Clock]:
    clock = _Clock()
    return PendingBook("ns", "node-a", max_wait_s, clock=clock, start_actor=False), clock


def test_pending_keys_are_a_family_of_their_own() -> None:
    key = prefix_keys(list(range(16)), 16)[0]
    pk = pending_key(key)
    assert pk != key and len(pk) == len(key)
    assert pk.endswith(PENDING_GROUP) and pk[:-4] == key[:-4]


def test_the_rule_waits_until_measured_numbers_say_computing_is_cheaper() -> None:
    book, clock = _book(max_wait_s=5.0)
    # nothing measured yet: wait, at most the namespace's longest wait
    assert book.decide(8) == 5.0
    assert book.deadline_s(8) == 5.0
    # this process computed 4 blocks: stored 0.4 s after they were announced
    keys = prefix_keys(list(range(4 * 16)), 16)
    book.announce(keys)
    clock.now += 0.4
    book.stored(keys)
    assert book.compute_s_per_block == pytest.approx(0.1)  # the last block of the four: 0.4 s / 4
    # loads are faster than computing: wait, for at most 1.5x our own compute time plus slack
    book.observe_load(0.02, 4)
    assert book.decide(8) == pytest.approx(WAIT_FACTOR * 0.8 + WAIT_SLACK_S)
    assert book.decide(1000) == 5.0  # never past the longest wait
    # loads slower than computing: compute
    book.load_s_per_block = 0.2
    assert book.decide(8) == 0.0
    assert book.counts["wait"] == 3 and book.counts["compute"] == 1 and book.counts["announce"] == 1


def test_a_claim_holds_back_a_share_of_the_compute() -> None:
    book, clock = _book(max_wait_s=5.0)
    assert book.claim_budget_s(4) == MIN_CLAIM_S  # nothing measured yet: the floor
    keys = prefix_keys(list(range(4 * 16)), 16)
    book.announce(keys)
    clock.now += 0.4
    book.stored(keys)  # 0.1 s per block
    assert book.claim_budget_s(8) == pytest.approx(CLAIM_SHARE * 0.8)
    assert book.claim_budget_s(2) == MIN_CLAIM_S
    assert book.claim_budget_s(1000) == 5.0  # never past the longest wait


def test_blocks_are_listed_only_when_their_prefill_takes_40_round_trips() -> None:
    book, clock = _book()
    assert book.listing_pays(2)  # nothing measured: list
    keys = prefix_keys(list(range(4 * 16)), 16)
    book.announce(keys)
    clock.now += 0.1
    book.released(keys)  # its claim answered: it computes from here
    clock.now += 0.4
    book.stored(keys, submitted=clock.now - 0.04)  # handed to the tier 0.36 s after its release
    assert book.prefill_s_per_block == pytest.approx(0.09)  # 0.36 s / 4
    assert book.compute_s_per_block == pytest.approx(0.125)  # 0.5 s from announcing to the store / 4
    assert book.listing_pays(2)  # no claim's round trip measured yet: list
    book.observe_claim(0.02)
    assert not book.listing_pays(8)  # 0.72 s of prefill, a 20 ms round trip: 2.8%
    assert book.listing_pays(9)  # 0.81 s: 2.5%
    book.observe_claim(0.5)  # one slow answer (a loaded shard) does not stop the listings
    assert book.claim_rtt_s == pytest.approx(0.02)
    assert book.listing_pays(9)
    book.observe_claim(0.04)  # most answers take 40 ms now: the lower median follows
    assert book.claim_rtt_s == pytest.approx(0.04)
    assert book.listing_pays(18) and not book.listing_pays(17)
    assert LISTING_PAYS_SHARE == 0.025


def test_the_prefill_estimate_is_a_lower_median_past_start_up() -> None:
    """An engine's first requests take seconds a block (its start-up), a request queued
    behind others takes longer: neither moves the estimate once most requests are quick."""
    book, clock = _book()

    def prefill(n: int, seconds: float) -> None:
        keys = prefix_keys(list(range(clock.counter, clock.counter + n * 16)), 16)
        clock.counter += n * 16
        book.announce(keys, listed=False)
        clock.now += seconds
        book.stored(keys, submitted=clock.now)

    clock.counter = 0  # type: ignore[attr-defined]
    prefill(2, 8.0)  # start-up: 4 s a block
    assert book.prefill_s_per_block == pytest.approx(4.0)
    prefill(2, 0.04)
    assert book.prefill_s_per_block == pytest.approx(0.02)  # the lower of the two
    prefill(1, 0.5)  # queued behind a long prefill
    prefill(3, 0.06)
    assert book.prefill_s_per_block == pytest.approx(0.02)
    assert book.compute_s_per_block > 1.0  # the compute estimate carries the start-up
    for _ in range(20):  # the window moves on: the oldest timings drop out
        prefill(1, 0.03)
    assert book.prefill_s_per_block == pytest.approx(0.03)
    # a store without its job's submission time, or handed over before the release, times no prefill
    keys = prefix_keys(list(range(90_000, 90_000 + 16)), 16)
    book.announce(keys, listed=False)
    book.stored(keys)
    keys = prefix_keys(list(range(91_000, 91_000 + 16)), 16)
    book.announce(keys, listed=False)
    book.stored(keys, submitted=clock.now - 1.0)
    assert book.prefill_s_per_block == pytest.approx(0.03)


def test_blocks_not_listed_are_still_timed() -> None:
    book, clock = _book()
    keys = prefix_keys(list(range(2 * 16)), 16)
    book.announce(keys, listed=False)
    clock.now += 0.6
    book.stored(keys)  # 0.3 s per block
    assert book.compute_s_per_block == pytest.approx(0.3)
    assert book.counts["short"] == 1 and book.counts["announce"] == 0


def test_a_request_that_ends_drops_the_entries_it_handed_no_store_for() -> None:
    """vLLM ends a request (``on_request_finished``) only once no store can be handed
    to a tier for it: blocks it listed and never handed a store for (its client hung
    up mid-prefill) will never be stored, so their entries end then; blocks whose
    store is in flight keep theirs until the store ends."""
    book, clock = _book()
    keys = prefix_keys(list(range(4 * 16)), 16)
    book.announce(keys)
    book.storing(keys[:1])
    assert book.ended(keys) == 3 and book.counts["dropped"] == 1
    assert book.ended(keys) == 0 and book.counts["dropped"] == 1  # ended once
    clock.now += 0.4
    book.stored(keys[:1])  # the store in flight still ends its entry and times it
    assert book.compute_s_per_block == pytest.approx(0.4)
    short = prefix_keys(list(range(100, 100 + 2 * 16)), 16)
    book.announce(short, listed=False)  # only timed: nothing listed, nothing to drop
    assert book.ended(short) == 0 and book.counts["dropped"] == 1
    # a failed store: the block's entry ends once no other store of it is in flight
    book.announce(keys)
    book.storing(keys[:2])
    book.storing(keys[:1])  # a second tier's store of the first block
    book.storing(keys[:2], change=-1)
    assert book.counts["dropped"] == 2 and pending_key(keys[1]) not in book.announced
    assert book.ended(keys) == 2  # the request ends: the two never handed over
    assert pending_key(keys[0]) in book.announced  # its other store is still in flight


def test_a_second_request_announcing_a_block_being_stored_keeps_its_store_in_flight() -> None:
    """Two requests of one engine compute the same new prefix: the second's announcement
    must not forget the first's store in flight, or the second's end would drop the
    entry before that store lands, nor the first's listing, or the store would leave
    the entry listed until its deadline."""
    book, _ = _book()
    keys = prefix_keys(list(range(2 * 16)), 16)
    book.announce(keys)
    book.storing(keys)  # the first request's store is in flight
    book.announce(keys)  # the second request computes the same blocks
    assert book.ended(keys) == 0 and book.counts["dropped"] == 0
    assert all(pending_key(k) in book.announced for k in keys)
    # a second request that computes them unlisted (``short``) keeps the first one's listing:
    # the store still ends the directory's entries
    book.announce(keys, listed=False)
    assert all(book.announced[pending_key(k)].listed for k in keys)


def test_a_request_that_ends_or_yields_keeps_the_entries_another_request_of_its_engine_lists() -> None:
    """Two requests of one engine list the same new prefix. The second's end (its client
    hung up) or its yield (another engine claimed the blocks first) must not end the
    entries while the first still computes them: engines waiting for them would compute
    them too. They end with the last request that lists them."""
    book, _ = _book()
    keys = prefix_keys(list(range(3 * 16)), 16)
    book.announce(keys)  # the first request lists them (it computes them: it gave up waiting, say)
    book.announce(keys)  # the second request too
    assert book.ended(keys, "request 2") == 0 and book.counts["dropped"] == 0
    assert all(pending_key(k) in book.announced for k in keys)
    assert book.ended(keys, "request 1") == 3 and book.counts["dropped"] == 1
    assert not book.announced

    book.announce(keys)
    book.announce(keys)
    book.withdraw(keys)  # the second yields: the first still computes them
    assert book.counts["yield"] == 1 and all(pending_key(k) in book.announced for k in keys)
    assert book.ended(keys, "request 1") == 3  # still listed until then
    book.announce(keys)
    book.withdraw(keys)  # a request alone that yields ends them, and they are not timed
    assert not book.announced and book.compute_s_per_block is None

    # an earlier request's store of them is in flight: a yield keeps the entries for it
    book.announce(keys)
    book.storing(keys)
    assert book.ended(keys, "request 1") == 0
    book.announce(keys)
    book.withdraw(keys)
    assert all(pending_key(k) in book.announced for k in keys)
    book.stored(keys)
    assert not book.announced and book.compute_s_per_block is not None


def test_a_block_computed_unlisted_is_forgotten_with_its_request() -> None:
    """A request that computes a few blocks unlisted (``short``) and ends without a
    store of them (its client hung up) leaves nothing in the book: no store will time
    them. A store in flight, another request computing them, or another request's
    listing keeps them."""
    book, _ = _book()
    keys = prefix_keys(list(range(2 * 16)), 16)
    book.announce(keys, listed=False)
    book.untimed(keys)
    assert not book.announced
    book.announce(keys, listed=False)
    book.storing(keys[:1])
    book.untimed(keys)
    assert list(book.announced) == [pending_key(keys[0])]  # its store in flight still times it
    book.stored(keys[:1])
    assert not book.announced and book.compute_s_per_block is not None
    book.announce(keys, listed=False)
    book.announce(keys, listed=False)  # a second request computes them too
    book.untimed(keys)
    assert len(book.announced) == 2
    book.untimed(keys)
    assert not book.announced
    book.announce(keys)  # another request lists them: its end, not this one's, ends them
    book.announce(keys, listed=False)
    book.untimed(keys)
    assert all(book.announced[pending_key(k)].listed for k in keys)
    assert book.ended(keys) == 2 and not book.announced
    book.announce(keys)
    book.announce(keys, listed=False)  # the lister ends first: the listing ends, the timing stays
    assert book.ended(keys) == 2 and not any(t.listed for t in book.announced.values())
    book.untimed(keys)
    assert not book.announced


def test_only_other_engines_pending_entries_are_waited_for() -> None:
    book, _ = _book()
    other = dataclasses.replace(book.info, holder_id="pending:node-b:1", node_id="node-b")
    assert book.others_compute([other])
    assert not book.others_compute([book.info])
    assert book.info.medium == PENDING
    assert not book.others_compute([]) and not book.others_compute(None)  # None: holders not known


# -- engines in their own processes ------------------------------------------------


@ray.remote(num_cpus=0)
class Engine:
    """One engine process: an object-store tier over its own primary region."""

    def __init__(self, namespace: str, model: str = "default") -> None:
        from raykv.core.factory import TierFactory
        from raykv.engine.primary import PrimaryRegion

        self.region = PrimaryRegion(16, BLOCK)
        services = raykv.attach(namespace)
        identity = DEFAULT_IDENTITY if model == "default" else KVIdentity(model=model)
        self.tier = TierFactory.create_tier(
            {"type": "object_store"}, self.region.view, services=services, identity=identity
        )
        self.contexts: dict[str, ReqContext] = {}
        self.job_ids = itertools.count(1)

    def step(self, keys: list[bytes], req_id: str, tenant: str | None = None) -> list[str]:
        """One scheduler step's lookups for a request: key by key, up to its first non-HIT."""
        ctx = self.contexts.get(req_id)
        if ctx is None:
            ctx = self.contexts[req_id] = ReqContext(req_id, tenant=tenant, prefix_keys=lambda: list(keys))
        out = []
        for k in keys:
            result = self.tier.lookup(k, ctx)
            out.append(result.name)
            if result is not LookupResult.HIT:
                break
        self.tier.on_schedule_end()
        return out

    def store(self, keys: list[bytes]) -> bool:
        from raykv.engine.tier_driver import TierDriver

        return TierDriver(self.tier).store(keys, list(range(len(keys)))).success

    def submit_store(self, keys: list[bytes], first_chunk: int = 0) -> int:
        """Hand the tier a store of ``keys`` (from primary chunks ``first_chunk`` on: past
        the region's 16, the holder cannot read them) without reading its result (an
        engine reads it at a later step); returns the job's id for ``store_result``."""
        import numpy as np

        from raykv.core.contract import TransferJob

        chunks = np.arange(first_chunk, first_chunk + len(keys))
        job = TransferJob(next(self.job_ids), keys, chunks, False, ReqContext("store"))
        self.tier.submit_store(job)
        return job.job_id

    def store_result(self, job_id: int) -> bool:
        from raykv.engine.tier_driver import TierDriver

        return TierDriver(self.tier).wait(job_id, 60).success

    def finish(self, req_id: str) -> None:
        """The engine ends request ``req_id`` (vLLM's ``on_request_finished``: no store
        can be handed to a tier for it any more)."""
        self.tier.on_request_finished(self.contexts[req_id])

    def end_entries(self, keys: list[bytes]) -> None:
        """End this engine's pending entries of ``keys`` as a store of them would, storing nothing."""
        self.tier._pending.book.stored([self.tier.scope(k) for k in keys])

    def measured(self, compute_s_per_block: float, claim_rtt_s: float | None = None) -> None:
        """Give this process a measured compute time, all of it prefill (as earlier
        stores would), and optionally a claim's round trip (as earlier claims would),
        once its pending holder is up (as an engine's is by its first request)."""
        book = self.tier._pending.book
        book.compute_s_per_block = compute_s_per_block
        book._prefill.set(compute_s_per_block)
        if claim_rtt_s is not None:
            book._claim_rtt.set(claim_rtt_s)
        ray.get(book._handle().ready.remote(), timeout=30)

    def forget_past(self, blocks: int) -> None:
        """Bound this process's book to ``blocks`` announced blocks (``MAX_TIMED``)."""
        import raykv.engine.announced

        raykv.engine.announced.MAX_TIMED = blocks

    def timed(self) -> int:
        """How many announced blocks this process's book remembers."""
        return len(self.tier._pending.book.announced)

    def claims_timed(self) -> int:
        """How many claims' round trips this process's estimate holds."""
        return len(self.tier._pending.book._claim_rtt)

    def decisions(self) -> dict[str, int]:
        rule = self.tier._pending
        return dict(rule.book.counts) if rule is not None else {}

    def close(self) -> None:
        self.tier.shutdown()
        self.region.close()


def _settled(engine, keys: list[bytes], req_id: str, timeout_s: float = 30.0, **kw) -> tuple[list[str], float]:
    """Step ``req_id`` until its lookups stop answering RETRY; (last answers, seconds it took)."""
    t0 = time.monotonic()
    last: list[list[str]] = []

    def settled() -> bool:
        last.append(ray.get(engine.step.remote(keys, req_id, **kw)))
        return last[-1][-1] != "RETRY"

    wait_until(settled, timeout_s=timeout_s, what=f"{req_id}'s lookups to settle", interval_s=0.02)
    return last[-1], time.monotonic() - t0


def _pending_holders(services, keys: list[bytes], identity: KVIdentity = DEFAULT_IDENTITY) -> list[list[str]]:
    """Per key, the holders of its pending entry (as the directory lists them)."""
    found = services.directory.lookup([pending_key(k) for k in scoped_keys(keys, identity)])
    return [[h.holder_id for h in hs if h.medium == PENDING] for hs in found]


@pytest.fixture(scope="module")
def services(ray_local):
    services = raykv.start(
        {"namespace": "raykv-pending", "directory_shards": 2, "pending_entries": True, "pending_max_wait_ms": 60_000}
    )
    yield services
    services.shutdown()


def test_a_second_engine_waits_for_the_first_and_loads(services) -> None:
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(6 * 16)), 16)
    try:
        answers, _ = _settled(a, keys, "a-1")
        assert answers == ["MISS"]  # nobody holds it: a computes it, and says so
        wait_until(
            lambda: all(_pending_holders(services, keys)),
            timeout_s=10,
            what="a's pending entries in the directory",
        )
        for _ in range(5):  # while a computes, b waits
            assert ray.get(b.step.remote(keys, "b-1")) == ["RETRY"]
        assert ray.get(b.decisions.remote())["wait"] == 1
        assert ray.get(a.store.remote(keys))  # a's blocks are computed and stored
        answers, _ = _settled(b, keys, "b-1")
        assert answers == ["HIT"] * 6
        got = ray.get(b.decisions.remote())
        assert got["loaded"] == 1 and got["gave_up"] == 0 and got["announce"] == 0
        assert ray.get(a.decisions.remote())["announce"] == 1
        wait_until(
            lambda: not any(_pending_holders(services, keys)),
            timeout_s=10,
            what="a's pending entries to end once stored",
        )
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_a_request_waits_while_its_later_blocks_are_pending(services) -> None:
    """A's entry for the first block has ended (its store lands block by block; this
    node may not see the block yet) while the rest are pending: B still waits."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(40_000, 40_000 + 5 * 16)), 16)
    try:
        assert _settled(a, keys, "a-5")[0] == ["MISS"]
        wait_until(lambda: all(_pending_holders(services, keys)), timeout_s=10, what="a's pending entries")
        ray.get(a.end_entries.remote(keys[:1]))
        wait_until(
            lambda: _pending_holders(services, keys)[0] == [], timeout_s=10, what="the first block's entry to end"
        )
        for _ in range(5):
            assert ray.get(b.step.remote(keys, "b-5")) == ["RETRY"]
        assert ray.get(a.store.remote(keys))
        assert _settled(b, keys, "b-5")[0] == ["HIT"] * 5
        assert ray.get(b.decisions.remote())["loaded"] == 1
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_a_waiter_past_its_own_estimate_waits_on_while_the_entries_live(services) -> None:
    """B measured its own compute at 10 ms a block, so its own wait is 0.34 s; A (loaded:
    10 s a block) is still computing after that. Computing now would cost B its whole
    compute on top of the wait: it waits on while A's entries live, then loads."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(42_000, 42_000 + 6 * 16)), 16)
    try:
        ray.get([a.measured.remote(10.0), b.measured.remote(0.01)])
        assert _settled(a, keys, "a-7")[0] == ["MISS"]
        wait_until(lambda: all(_pending_holders(services, keys)), timeout_s=10, what="a's pending entries")
        assert ray.get(b.step.remote(keys, "b-7")) == ["RETRY"]
        own_wait_ends = time.monotonic() + WAIT_FACTOR * 0.01 * 6 + WAIT_SLACK_S
        while time.monotonic() < own_wait_ends + 1.0:  # a second past its own wait
            assert ray.get(b.step.remote(keys, "b-7")) == ["RETRY"]
            time.sleep(0.05)
        assert ray.get(a.store.remote(keys))
        assert _settled(b, keys, "b-7")[0] == ["HIT"] * 6
        got = ray.get(b.decisions.remote())
        assert got["wait"] == 1 and got["loaded"] == 1 and got["gave_up"] == 0, got
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_two_engines_that_announce_at_once_compute_it_once(services) -> None:
    """Both get the same new prefix at the same moment, so both announce it; the one
    whose entry reached the directory second sees the other's first, withdraws its
    own and waits; the first computes. Their measured compute time (0.5 s a block)
    gives each up to 0.3 s to see whose entry came first."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(45_000, 45_000 + 6 * 16)), 16)
    try:
        ray.get([a.measured.remote(0.5), b.measured.remote(0.5)])
        answers: dict[str, list[list[str]]] = {"a": [], "b": []}

        def one_settled() -> bool:
            now = ray.get([a.step.remote(keys, "a-6"), b.step.remote(keys, "b-6")])
            answers["a"].append(now[0])
            answers["b"].append(now[1])
            return "MISS" in (now[0][-1], now[1][-1])

        wait_until(one_settled, timeout_s=10, what="one engine to compute", interval_s=0.02)
        computes, waits = (a, b) if answers["a"][-1] == ["MISS"] else (b, a)
        waiter = "b-6" if waits is b else "a-6"

        def waiting() -> bool:  # (it may still be checking its claim: RETRY all along)
            assert ray.get(waits.step.remote(keys, waiter)) == ["RETRY"]
            return ray.get(waits.decisions.remote())["wait"] == 1

        wait_until(waiting, timeout_s=10, what="the other engine to wait", interval_s=0.02)
        for _ in range(5):  # and it goes on waiting while the first computes
            assert ray.get(waits.step.remote(keys, waiter)) == ["RETRY"]
        first, second = ray.get([computes.decisions.remote(), waits.decisions.remote()])
        assert first["announce"] == 1 and first["yield"] == 0, first
        # the second either yielded its own announcement or saw the first's before announcing
        assert second["announce"] - second["yield"] == 0 and second["wait"] == 1, second
        wait_until(
            lambda: all(len(hs) == 1 for hs in _pending_holders(services, keys)),
            timeout_s=10,
            what="one engine's entries only",
        )
        assert ray.get(computes.store.remote(keys))
        answers_b, _ = _settled(waits, keys, waiter)
        assert answers_b == ["HIT"] * 6
        assert ray.get(waits.decisions.remote())["loaded"] == 1
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_a_warm_up_waits_until_the_pending_holder_runs(services) -> None:
    """A book starts its holder at once (a worker process: about a CPU second), not at
    its first listing; ``wait_started`` returns once it runs, so that a warm-up keeps
    that start out of a trace's timings. A process without a book has nothing to wait for."""
    assert wait_started(10.0)  # this (driver) process has no book yet
    book = pending_book(services)
    assert book is not None and book._actor is not None  # started with the book
    try:
        assert not wait_started(0.0)  # a worker process does not start in no time
        assert wait_started(60.0)
        done, _ = ray.wait([book._actor.ready.remote()], timeout=1.0)
        assert done  # it runs: no start left to wait for
    finally:
        ray.kill(book._actor)
        _books.pop(services, None)


def test_a_few_blocks_are_computed_without_listing_them(services) -> None:
    """A request whose blocks prefill in less than 40 claims' round trips (a chat
    turn's new part) computes them as without pending entries: its first
    lookup answers MISS, nothing is listed or claimed. A long prefix on the same
    engine is listed and claimed."""
    a = Engine.remote("raykv-pending")
    few = prefix_keys(list(range(46_000, 46_000 + 2 * 16)), 16)
    many = prefix_keys(list(range(47_000, 47_000 + 6 * 16)), 16)
    try:
        # 2 blocks at 0.1 s: 0.2 s of prefill against a claim's 20 ms round trip (10%)
        ray.get(a.measured.remote(0.1, claim_rtt_s=0.02))
        answers, _ = _settled(a, few, "a-few")
        assert answers == ["MISS"]
        counts = ray.get(a.decisions.remote())
        assert counts["short"] == 1 and counts["announce"] == 0 and counts["claim"] == 0, counts
        time.sleep(0.5)  # (an entry would be in the shard's books by now)
        assert not any(_pending_holders(services, few))
        # 6 blocks at 1 s: 6 s of compute, a 20 ms round trip: listed and claimed (its round trip measured)
        ray.get(a.measured.remote(1.0, claim_rtt_s=0.02))
        assert _settled(a, many, "a-many")[0] == ["MISS"]
        counts = ray.get(a.decisions.remote())
        assert counts["announce"] == 1 and counts["claim"] == 1, counts
        wait_until(lambda: all(_pending_holders(services, many)), timeout_s=10, what="the long prefix's entries")
        wait_until(lambda: ray.get(a.claims_timed.remote()) == 2, timeout_s=10, what="the claim's round trip")
        assert ray.get(a.store.remote(few)) and ray.get(a.store.remote(many))
    finally:
        ray.get(a.close.remote())


def test_a_few_blocks_that_end_unstored_are_forgotten(services) -> None:
    """A request that computes a few blocks unlisted (``short``) and ends without
    storing them (its client hung up): the engine's book forgets them at its end."""
    a = Engine.remote("raykv-pending")
    few = prefix_keys(list(range(48_000, 48_000 + 2 * 16)), 16)
    try:
        ray.get(a.measured.remote(0.1, claim_rtt_s=0.02))
        assert _settled(a, few, "a-short")[0] == ["MISS"]
        assert ray.get(a.decisions.remote())["short"] == 1 and ray.get(a.timed.remote()) == 2
        ray.get(a.finish.remote("a-short"))
        assert ray.get(a.timed.remote()) == 0
    finally:
        ray.get(a.close.remote())


def test_listed_blocks_the_book_forgets_end_their_entries(services) -> None:
    """Past ``MAX_TIMED`` announced blocks, an engine's book forgets the oldest. A
    listed one's entry ends then (waiters compute), rather than at its deadline (a
    minute here): the book would not end it at its store any more."""
    a = Engine.remote("raykv-pending")
    old = prefix_keys(list(range(49_000, 49_000 + 4 * 16)), 16)
    new = prefix_keys(list(range(49_500, 49_500 + 4 * 16)), 16)
    try:
        assert _settled(a, old, "a-old")[0] == ["MISS"]
        wait_until(lambda: all(_pending_holders(services, old)), timeout_s=10, what="the old blocks' entries")
        ray.get(a.forget_past.remote(4))
        assert _settled(a, new, "a-new")[0] == ["MISS"]
        wait_until(lambda: not any(_pending_holders(services, old)), timeout_s=10, what="the old entries to end")
        wait_until(lambda: all(_pending_holders(services, new)), timeout_s=10, what="the new blocks' entries")
        assert ray.get(a.timed.remote()) == 4
    finally:
        ray.get(a.close.remote())


def test_another_model_or_tenant_never_waits_for_them(services) -> None:
    a = Engine.remote("raykv-pending")
    other_model = Engine.remote("raykv-pending", model="another-model")
    keys = prefix_keys(list(range(50_000, 50_000 + 4 * 16)), 16)
    try:
        assert _settled(a, keys, "a-2")[0] == ["MISS"]
        wait_until(lambda: all(_pending_holders(services, keys)), timeout_s=10, what="a's pending entries")
        assert _settled(other_model, keys, "m-1")[0] == ["MISS"]
        assert ray.get(other_model.decisions.remote())["wait"] == 0
        b = Engine.remote("raykv-pending")
        assert _settled(b, keys, "b-2", tenant="tenant-b")[0] == ["MISS"]
        assert ray.get(b.decisions.remote())["wait"] == 0
        ray.get(b.close.remote())
    finally:
        ray.get([a.close.remote(), other_model.close.remote()])


def test_a_computing_engine_that_dies_costs_waiters_no_more_than_its_death(services) -> None:
    """The deadline is a minute; the computing engine is killed: its pending holder
    dies with it, the directory drops its entries, and the waiter computes."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(60_000, 60_000 + 4 * 16)), 16)
    try:
        assert _settled(a, keys, "a-3")[0] == ["MISS"]
        wait_until(lambda: all(_pending_holders(services, keys)), timeout_s=10, what="a's pending entries")
        assert ray.get(b.step.remote(keys, "b-3")) == ["RETRY"]
        ray.kill(a, no_restart=True)
        answers, took = _settled(b, keys, "b-3", timeout_s=30)
        assert answers == ["MISS"] and took < 20, (answers, took)
        assert ray.get(b.decisions.remote())["gave_up"] == 1
    finally:
        ray.get(b.close.remote())


def _b_waits_for_a(services, a, b, keys: list[bytes], n: str) -> None:
    """A's request ``a-<n>`` computes ``keys`` (listed as pending); B's ``b-<n>`` waits for them."""
    assert _settled(a, keys, f"a-{n}")[0] == ["MISS"]
    wait_until(lambda: all(_pending_holders(services, keys)), timeout_s=10, what="a's pending entries")
    assert ray.get(b.step.remote(keys, f"b-{n}")) == ["RETRY"]


def test_a_request_that_ends_unstored_ends_its_entries_and_its_waiters_compute(services) -> None:
    """A's client hangs up mid-prefill: A's engine ends the request without handing a
    store of its blocks to the tier. Their entries end then, not at their deadline (a
    minute here), and B, which was waiting for them, computes them."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(62_000, 62_000 + 4 * 16)), 16)
    try:
        _b_waits_for_a(services, a, b, keys, "8")
        ray.get(a.finish.remote("a-8"))
        answers, took = _settled(b, keys, "b-8", timeout_s=20)
        assert answers == ["MISS"] and took < 10, (answers, took)
        assert ray.get(b.decisions.remote())["gave_up"] == 1
        assert ray.get(a.decisions.remote())["dropped"] == 1
        wait_until(lambda: not any(_pending_holders(services, keys)), timeout_s=10, what="a's entries to end")
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_a_request_that_ends_with_its_store_in_flight_keeps_its_entries(services) -> None:
    """A hands the store of its blocks to the tier, then ends the request before the
    store's result is read (vLLM's order for a request's last blocks): the entries
    stay until the store ends, and B, waiting, loads A's copy."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(64_000, 64_000 + 4 * 16)), 16)
    try:
        _b_waits_for_a(services, a, b, keys, "9")
        job = ray.get(a.submit_store.remote(keys))
        ray.get(a.finish.remote("a-9"))
        time.sleep(1.0)  # (a dropped entry would have left the shard's books by now)
        assert all(_pending_holders(services, keys))
        assert ray.get(a.decisions.remote())["dropped"] == 0
        assert ray.get(a.store_result.remote(job))
        assert _settled(b, keys, "b-9")[0] == ["HIT"] * 4
        got = ray.get(b.decisions.remote())
        assert got["loaded"] == 1 and got["gave_up"] == 0, got
        wait_until(lambda: not any(_pending_holders(services, keys)), timeout_s=10, what="a's entries to end")
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_a_failed_store_ends_its_entries_and_its_waiters_compute(services) -> None:
    """A's store of its blocks fails (its holder cannot read the chunks): vLLM hands a
    block's store to a tier once, so A will never store them. Their entries end then,
    not at their deadline (a minute here), and B, waiting for them, computes them."""
    a, b = Engine.remote("raykv-pending"), Engine.remote("raykv-pending")
    keys = prefix_keys(list(range(66_000, 66_000 + 4 * 16)), 16)
    try:
        _b_waits_for_a(services, a, b, keys, "10")
        job = ray.get(a.submit_store.remote(keys, first_chunk=1000))
        assert not ray.get(a.store_result.remote(job))
        answers, took = _settled(b, keys, "b-10", timeout_s=20)
        assert answers == ["MISS"] and took < 10, (answers, took)
        assert ray.get(a.decisions.remote())["dropped"] == 1
        wait_until(lambda: not any(_pending_holders(services, keys)), timeout_s=10, what="a's entries to end")
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_an_entry_ends_at_its_deadline(ray_local) -> None:
    services = raykv.start(
        {
            "namespace": "raykv-pending-deadline",
            "directory_shards": 2,
            "pending_entries": True,
            "pending_max_wait_ms": 2000,
        }
    )
    a, b = Engine.remote("raykv-pending-deadline"), Engine.remote("raykv-pending-deadline")
    keys = prefix_keys(list(range(70_000, 70_000 + 4 * 16)), 16)
    try:
        assert _settled(a, keys, "a-4")[0] == ["MISS"]  # a announces, and never stores
        wait_until(lambda: all(_pending_holders(services, keys)), timeout_s=10, what="a's pending entries")
        answers, took = _settled(b, keys, "b-4")
        assert answers == ["MISS"] and took < 8, (answers, took)
        assert ray.get(b.decisions.remote())["gave_up"] == 1
        wait_until(
            lambda: not any(_pending_holders(services, keys)), timeout_s=5, what="a's entries to pass their deadline"
        )
    finally:
        ray.get([a.close.remote(), b.close.remote()])
        services.shutdown()
