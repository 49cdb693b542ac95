"""Pending entries: blocks an engine is computing right now, in the directory.

When an engine starts computing a prefix that no holder has, it lists the
blocks' ``pending_key``s (their own key family: tier lookups never see them)
under its ``PendingActor``. Another engine whose lookup meets them may wait
for the blocks to register instead of computing them too
(``raykv.engine.pending``). An entry ends, and its key leaves the directory:

- when the computing engine's store of the block succeeds (``finish``);
- when its request ends without handing the block's store to a tier, or
  that store fails (``drop``: a client that hung up, an aborted request);
- when its deadline passes (the actor drops it: a store that never came);
- when the engine dies: the actor is owned by the engine process, and the
  directory shards, which watch every holder, drop all its keys at once.

A pending entry is never loaded from: nothing but the ``PENDING`` medium
names it, and no tier reads that medium.
"""

from __future__ import annotations

import asyncio
import time

import ray

from raykv.core.wire import PENDING, HolderInfo, Report
from raykv.holders.holder_actor import HolderActor, process_holder_info

TIER_TYPE = "pending"
#: Longest pause between two deadline sweeps (a sweep also runs at the soonest deadline).
SWEEP_S = 0.05


def holder_info(namespace: str, node_id: str, owner: str | None, pid: int | None = None) -> HolderInfo:
    """The directory holder of the pending entries of engine process ``pid`` (default: this one)."""
    return process_holder_info(TIER_TYPE, PENDING, namespace, node_id, owner, pid)


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
class PendingActor(HolderActor):
    """The blocks one engine process is computing now, each until its deadline."""

    def __init__(self, info: HolderInfo, namespace: str) -> None:
        super().__init__(
            info,
            namespace,
            {"announced": "raykv_tier_stored_blocks", "expired": "raykv_tier_evicted_blocks"},
        )
        self.requested_capacity = 0
        #: pending key -> monotonic deadline
        self._until: dict[bytes, float] = {}
        self._listed = asyncio.Event()  # set while entries are listed: an idle actor sleeps
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    def __repr__(self) -> str:
        info = self.__dict__.get("info")
        owner = getattr(info, "owner", None) or "-"
        return f"PendingEntries(node={str(getattr(info, 'node_id', '?'))[:12]}, replica={owner[:12]})"

    def held_keys(self) -> list[bytes]:
        return list(self._until)

    def occupancy(self) -> tuple[int, int, int]:
        return len(self._until), 0, 0

    def status_line(self) -> str:
        until = self.__dict__.get("_until", {})
        return (
            f"pending entries {self.info.holder_id}: {len(until)} blocks being computed; "
            f"{self.counters['announced']} announced, {self.counters['finished']} stored, "
            f"{self.counters['dropped']} dropped (not stored after all), {self.counters['expired']} expired"
        )

    def describe(self) -> Report:
        return {"node_id": self.info.node_id, "owner": self.info.owner}

    def tier_stats(self) -> Report:
        return {"blocks": len(self._until), **self.counters}

    async def announce(self, keys: list[bytes], ttl_s: float) -> int:
        """List ``keys`` (pending keys) for ``ttl_s`` seconds from now; a key
        listed already keeps the later of its two deadlines. Returns new keys."""
        await self._started
        until = time.monotonic() + max(0.0, float(ttl_s))
        new = [k for k in dict.fromkeys(keys) if k not in self._until]
        for k in keys:
            self._until[k] = max(until, self._until.get(k, 0.0))
        self.counters["announced"] += len(new)
        self._listed.set()
        self.log.append(False, new)
        await self._register(new)
        self._publish()
        return len(new)

    async def finish(self, keys: list[bytes]) -> int:
        """The blocks of ``keys`` are stored: their entries end now."""
        return await self._end(keys, "finished")

    async def drop(self, keys: list[bytes]) -> int:
        """The blocks of ``keys`` will not be stored after all (their request ended
        first, or their store failed): their entries end now."""
        return await self._end(keys, "dropped")

    async def _end(self, keys: list[bytes], counter: str) -> int:
        """End the entries of ``keys`` that are listed, counted under ``counter``; how many."""
        await self._started
        gone = [k for k in dict.fromkeys(keys) if self._until.pop(k, None) is not None]
        self.counters[counter] += len(gone)
        await self._drop(gone)
        return len(gone)

    async def _drop(self, gone: list[bytes]) -> None:
        self.log.append(True, gone)
        await self._unregister(gone)
        self._publish()

    def _expired(self, now: float) -> list[bytes]:
        gone = [k for k, t in self._until.items() if t <= now]
        for k in gone:
            del self._until[k]
        self.counters["expired"] += len(gone)
        return gone

    async def _sweep_forever(self) -> None:
        await self._started
        while True:
            if not self._until:
                self._listed.clear()
                await self._listed.wait()
            now = time.monotonic()
            gone = self._expired(now)
            if gone:
                await self._drop(gone)
            soonest = min(self._until.values(), default=now + SWEEP_S)
            await asyncio.sleep(min(SWEEP_S, max(0.0, soonest - time.monotonic())) or SWEEP_S / 10)
