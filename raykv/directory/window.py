"""``AgentWindow``: what a node agent collects in one window, as one call per shard.

Engines' lookups and holders' registrations and evictions that reach the agent
within one window become one ``ShardBatch`` per shard: the key changes in the
order they arrived (a holder's register then unregister of a key stays in that
order), then one lookup of the distinct keys asked. Plain Python, no Ray: the
agent sends the batches and hands the replies back to ``settle``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from raykv.core.wire import LookupReply
from raykv.directory.fingerprint import to_blob
from raykv.directory.messages import FeedOp, KeyOp, ShardBatch, ShardBatchReply

#: ``answer(shard, fps, reply) -> view set ids``: how the agent keeps and translates a shard's answer.
Answer = Callable[[int, np.ndarray, LookupReply], np.ndarray]


class _Lookup:
    __slots__ = ("fps", "shards", "future")

    def __init__(self, fps: np.ndarray, shards: np.ndarray, future: asyncio.Future[np.ndarray]) -> None:
        self.fps, self.shards, self.future = fps, shards, future


class AgentWindow:
    """One window's lookups and key changes, until ``batches`` is called once."""

    def __init__(self) -> None:
        self._lookups: list[_Lookup] = []
        self._ops: dict[int, list[tuple[KeyOp, asyncio.Future[int]]]] = {}
        # set by ``batches``: the distinct keys asked, each key's place among them, per shard its keys
        self._uniq = np.zeros(0, dtype=np.uint64)
        self._inverse = np.zeros(0, dtype=np.int64)
        self._asked: dict[int, np.ndarray] = {}

    @property
    def engine_calls(self) -> int:
        return len(self._lookups)

    def __bool__(self) -> bool:
        return bool(self._lookups or self._ops)

    def covers(self, shard: int) -> bool:
        """Whether the window will send ``shard`` a call (its changes or keys asked)."""
        return shard in self._ops or any(bool((w.shards == shard).any()) for w in self._lookups)

    def lookup(self, fps: np.ndarray, shards: np.ndarray, future: asyncio.Future[np.ndarray]) -> None:
        """Keys to look up; ``future`` gets their view set ids."""
        self._lookups.append(_Lookup(fps, shards, future))

    def change(self, op: FeedOp, holder_id: str, fps: np.ndarray, shards: np.ndarray) -> list[asyncio.Future[int]]:
        """A holder's keys registered or unregistered; one future per shard touched (keys changed there)."""
        loop = asyncio.get_running_loop()
        futures = []
        for shard in np.unique(shards).tolist():
            future: asyncio.Future[int] = loop.create_future()
            self._ops.setdefault(int(shard), []).append((KeyOp(op, holder_id, to_blob(fps[shards == shard])), future))
            futures.append(future)
        return futures

    def batches(self) -> dict[int, ShardBatch]:
        """Per shard its one call: the changes in order, then the lookup of its distinct keys."""
        if self._lookups:
            all_fps = np.concatenate([w.fps for w in self._lookups])
            all_shards = np.concatenate([w.shards for w in self._lookups])
            self._uniq, first, self._inverse = np.unique(all_fps, return_index=True, return_inverse=True)
            owner = all_shards[first]
            self._asked = {int(s): np.flatnonzero(owner == s) for s in np.unique(owner)}
        out = {}
        for shard in sorted(set(self._ops) | set(self._asked)):
            ask = self._asked.get(shard)
            ops = tuple(op for op, _ in self._ops.get(shard, ()))
            out[shard] = ShardBatch(ops, to_blob(self._uniq[ask]) if ask is not None else b"")
        return out

    def settle(self, replies: dict[int, ShardBatchReply | BaseException], answer: Answer) -> None:
        """Hand each shard's reply to whoever waits for it. A shard that failed
        answers "nobody" to lookups (a miss) and raises to its changes' callers."""
        ids = np.zeros(len(self._uniq), dtype=np.uint32)
        for shard, reply in replies.items():
            ops = self._ops.get(shard, [])
            if isinstance(reply, BaseException):
                for _, future in ops:
                    future.set_exception(reply)
                continue
            for (_, future), count in zip(ops, reply.counts):
                future.set_result(count)
            ask = self._asked.get(shard)
            if ask is not None and reply.lookup is not None:
                ids[ask] = answer(shard, self._uniq[ask], reply.lookup)
        start = 0
        for w in self._lookups:
            w.future.set_result(ids[self._inverse[start : start + len(w.fps)]])
            start += len(w.fps)

    def fail(self, error: BaseException) -> None:
        """Nothing could be sent: lookups answer "nobody", changes raise ``error``."""
        for w in self._lookups:
            if not w.future.done():
                w.future.set_result(np.zeros(len(w.fps), dtype=np.uint32))
        for ops in self._ops.values():
            for _, future in ops:
                if not future.done():
                    future.set_exception(error)
