"""What a router sent where: requests still in flight per replica, and the blocks
each replica was sent to compute. Plain bookkeeping (no Ray), fed by Serve's
``on_request_routed`` / ``on_request_completed`` hooks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

R = TypeVar("R", bound=Hashable)  # a replica's id

#: Completions of requests not counted as routed that are remembered (``InflightRequests``).
EARLY_COMPLETIONS = 10_000
#: Requests whose predicted work waits for their ``on_request_routed`` (``PredictedWork``).
PENDING_PREDICTIONS = 10_000
#: How long a block sent to a replica to compute counts as held there (``RecentPrefixes``):
#: by then its engine's KV events list it in the directory, if it still holds it.
SOON_HELD_S = 10.0
#: Most blocks ``RecentPrefixes`` remembers (oldest dropped first).
SOON_HELD_KEYS = 200_000
#: How long a decided request counts where it was ranked first, until Serve reports
#: where it went (``ExpectedRoutes``): the report comes within milliseconds, or never
#: (a request Serve gave up on, or Serve's rejection protocol off).
EXPECTED_S = 2.0


class InflightRequests(Generic[R]):
    """Requests sent to each replica that have not ended.

    A completion of a request not counted (a rejected send, or one whose end was
    heard before it was counted as routed) is remembered a while, so that a late
    ``routed`` of it counts nothing: the count may miss a request, never keep one
    that ended."""

    def __init__(self, remember_early: int = EARLY_COMPLETIONS) -> None:
        self.remember_early = remember_early
        self._count: dict[R, int] = {}
        self._replica_of: dict[str, R] = {}
        self._ended_early: OrderedDict[str, R] = OrderedDict()

    def routed(self, request_id: str, replica: R) -> None:
        if self._ended_early.pop(request_id, None) == replica:
            return  # it ended there before it was counted: nothing in flight
        self._replica_of[request_id] = replica
        self._count[replica] = self._count.get(replica, 0) + 1

    def completed(self, request_id: str, replica: R) -> None:
        counted_on = self._replica_of.pop(request_id, None)
        if counted_on is None:
            self._ended_early[request_id] = replica
            self._ended_early.move_to_end(request_id)
            while len(self._ended_early) > self.remember_early:
                self._ended_early.popitem(last=False)
            return
        left = self._count.get(counted_on, 1) - 1
        if left > 0:
            self._count[counted_on] = left
        else:
            self._count.pop(counted_on, None)

    def count(self, replica: R) -> int:
        return self._count.get(replica, 0)

    @property
    def remembered_early(self) -> int:
        """Completions remembered of requests not counted (at most ``remember_early``)."""
        return len(self._ended_early)


class ExpectedRoutes(Generic[R]):
    """Decided requests Serve has not reported routed yet, each counted where it was
    ranked first (at most ``ttl_s``). Decisions made in the same few milliseconds
    (a burst) would otherwise all see the same queues and pile onto one replica."""

    def __init__(self, ttl_s: float = EXPECTED_S, max_pending: int = PENDING_PREDICTIONS) -> None:
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._where: OrderedDict[int, tuple[R, float]] = OrderedDict()

    def expect(self, request: int, replica: R, now: float) -> None:
        """``request`` was decided now and ranked ``replica`` first (a new decision of it replaces the last)."""
        self._where.pop(request, None)
        self._where[request] = (replica, now + self.ttl_s)
        while len(self._where) > self.max_pending:
            self._where.popitem(last=False)

    def settled(self, request: int) -> None:
        """Serve reported ``request`` routed, or it is being decided again."""
        self._where.pop(request, None)

    def counts(self, now: float) -> dict[R, int]:
        """Per replica, the decided requests expected there and not reported yet."""
        while self._where:  # oldest first: drop the expired ones
            first = next(iter(self._where.values()))
            if first[1] > now:
                break
            self._where.popitem(last=False)
        out: dict[R, int] = {}
        for replica, _ in self._where.values():
            out[replica] = out.get(replica, 0) + 1
        return out


class PredictedWork(Generic[R]):
    """Blocks each replica was sent to compute: what spreads fresh prompts among
    replicas that would all compute them. A decision predicts, per replica, what
    the request would compute there; the replica it is routed to is charged."""

    def __init__(self, max_pending: int = PENDING_PREDICTIONS) -> None:
        self.max_pending = max_pending
        self._blocks: dict[R, float] = {}
        self._pending: OrderedDict[int, Mapping[R, int]] = OrderedDict()

    def predict(self, request: int, blocks_by_replica: Mapping[R, int]) -> None:
        self._pending[request] = blocks_by_replica
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def routed(self, request: int, replica: R) -> None:
        predicted = self._pending.pop(request, None)
        if predicted is not None:
            self._blocks[replica] = self._blocks.get(replica, 0.0) + predicted.get(replica, 0)

    def sent(self, replica: R) -> float:
        """Blocks ``replica`` was sent to compute so far."""
        return self._blocks.get(replica, 0.0)


class RecentPrefixes(Generic[R]):
    """Blocks this router recently sent a replica to compute, each for ``ttl_s``:
    held there soon, before the engine's KV events say so. A request whose
    prefix was just sent somewhere goes there too while it has room, instead
    of computing the prefix a second time elsewhere."""

    def __init__(self, ttl_s: float = SOON_HELD_S, max_keys: int = SOON_HELD_KEYS) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._pending: OrderedDict[int, list[bytes]] = OrderedDict()
        self._where: OrderedDict[bytes, tuple[R, float]] = OrderedDict()

    def predict(self, request: int, keys: list[bytes], expected: R | None = None, now: float = 0.0) -> None:
        """The blocks (engine keys, prompt order) request ``request`` computes where it is
        routed. With ``expected`` (the replica it was ranked first on), they count as held
        there from now, for ``EXPECTED_S``, where no routed request has them: a burst
        decided before Serve reports the first one routed follows it."""
        self._pending[request] = keys
        while len(self._pending) > PENDING_PREDICTIONS:
            self._pending.popitem(last=False)
        if expected is None:
            return
        until = now + EXPECTED_S
        for k in keys:
            where = self._where.get(k)
            if where is None or where[1] < now:
                self._where[k] = (expected, until)
                self._where.move_to_end(k)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def routed(self, request: int, replica: R, now: float) -> None:
        keys = self._pending.pop(request, None)
        if not keys:
            return
        until = now + self.ttl_s
        for k in keys:
            self._where[k] = (replica, until)
            self._where.move_to_end(k)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def leading(self, keys: list[bytes], now: float) -> dict[R, int]:
        """Per replica, how many of ``keys``' leading blocks it was sent to compute lately."""
        out: dict[R, int] = {}
        replica = None
        for i, k in enumerate(keys):
            where = self._where.get(k)
            if where is None or where[1] < now or (replica is not None and where[0] != replica):
                break
            replica = where[0]
            out[replica] = i + 1
        return out


class RouterBook(Generic[R]):
    """One router's books, fed by its decisions and Serve's hooks: requests in flight
    per replica, requests decided and not reported routed yet, the new work each
    replica was sent, and the prefixes it will hold soon."""

    #: Decided requests count where they ranked first until Serve reports them routed,
    #: unless this many decisions went by without one report (``on_request_routed`` is
    #: not called without Serve's rejection protocol, as under Ray Client).
    EXPECT_UNHEARD = 16

    def __init__(self) -> None:
        self.inflight: InflightRequests[R] = InflightRequests()
        self.expected: ExpectedRoutes[R] = ExpectedRoutes()
        self.work: PredictedWork[R] = PredictedWork()
        self.recent: RecentPrefixes[R] = RecentPrefixes()
        self.routed_heard = False  # whether Serve reported a request routed yet

    def decided(
        self, request: int, first: R, recompute: Mapping[R, int], keys: list[bytes], decisions: int, now: float
    ) -> None:
        """``request`` ranked ``first`` first; ``recompute``: the blocks it would compute on each
        replica; ``keys``: its engine keys. Until Serve reports where it went, it counts on
        ``first``: in its queue, and its prefix as held there soon."""
        expected = first if self.routed_heard or decisions < self.EXPECT_UNHEARD else None
        if expected is not None:
            self.expected.expect(request, expected, now)
        self.work.predict(request, recompute)
        self.recent.predict(request, keys, expected, now)

    def routed(self, request: int, request_id: str, replica: R, now: float) -> None:
        """Serve's ``on_request_routed``: ``request`` (``request_id``: Serve's internal id) went to ``replica``."""
        self.routed_heard = True
        self.expected.settled(request)
        self.work.routed(request, replica)
        self.recent.routed(request, replica, now)
        self.inflight.routed(request_id, replica)

    def queues(self, replicas: Mapping[R, int | None], now: float) -> dict[R, int]:
        """Each replica's queue: in flight plus the requests decided for it and not reported
        routed yet, or Serve's figure (given per replica) when higher. Serve counts a request
        from when it sends it, before the replica accepts it (``on_request_routed``): adding
        the decided ones to Serve's figure would count those twice."""
        expected = self.expected.counts(now)
        return {r: max(int(serve or 0), self.inflight.count(r) + expected.get(r, 0)) for r, serve in replicas.items()}
