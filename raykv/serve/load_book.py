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

    def predict(self, request: int, keys: list[bytes]) -> None:
        """The blocks (engine keys, prompt order) request ``request`` computes where it is routed."""
        self._pending[request] = keys
        while len(self._pending) > PENDING_PREDICTIONS:
            self._pending.popitem(last=False)

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
