"""``ExampleNodeTier``: the smallest cluster-wide tier, built on raykv's bases.

Blocks live in the heap of one actor per node and are found through the
directory, so every engine of the node (any process) loads what any other
stored. The tier writes its storage and nothing else:

- the holder actor (``ExampleNodeActor(HolderActor)``) keeps an LRU dict of
  blocks and answers ``store`` / ``load`` by mapping the engine's primary
  region (no block bytes in actor-call arguments) with a ``StoreAnswer`` /
  ``LoadAnswer`` (``raykv.core.wire``); announcing, death watching, shard
  rebuilds, reconciling, KV events, metrics, ``ready`` and the status line
  come from ``raykv.holders.holder_actor``;
- the engine side (``ExampleNodeTier(ActorCallTier)``) sends one actor call
  per job; lookups, placement, job tracking, timeouts and results (from
  those answers) come from ``raykv.engine.actor_tier``.

``tiers/object_store`` has the same shape with plasma packs and cross-node
pulls. Config: ``{"type": "example_node", "capacity_bytes": ...}``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import ray

from raykv.core.contract import TransferJob
from raykv.core.fields import bytes_option, namespace_option, opt
from raykv.core.identity import KVIdentity
from raykv.core.placement import PLASMA, HolderInfo
from raykv.core.units import fmt_bytes
from raykv.core.wire import LoadAnswer, Report, StoreAnswer
from raykv.engine.actor_tier import ActorCallTier
from raykv.engine.polling import ActorLiveness
from raykv.engine.primary import MappedRegion, RegionHandle, describe_region
from raykv.holders.holder_actor import HolderActor, start_on_node
from raykv.services.cluster import RaykvServices

TIER_TYPE = "example_node"


def holder_info(node_id: str, namespace: str) -> HolderInfo:
    """The directory holder of a node's example actor."""
    return HolderInfo(f"{TIER_TYPE}:{node_id}", TIER_TYPE, PLASMA, f"raykv-example-node-{node_id}", namespace, node_id)


@ray.remote(num_cpus=0, max_restarts=-1)  # an async actor: Ray serves 1000 calls at a time
class ExampleNodeActor(HolderActor):
    """A node's blocks in this actor's memory, least recently used evicted first."""

    def __init__(self, node_id: str, namespace: str, capacity_bytes: int) -> None:
        super().__init__(
            holder_info(node_id, namespace),
            namespace,
            {
                "stored": "raykv_tier_stored_blocks",
                "evicted": "raykv_tier_evicted_blocks",
                "served": "raykv_tier_served_blocks",
            },
        )
        self.node_id = node_id
        self.capacity = int(capacity_bytes)
        self.requested_capacity = self.capacity
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._regions: dict[RegionHandle, MappedRegion] = {}

    def __repr__(self) -> str:
        return f"ExampleNode(node={str(self.__dict__.get('node_id', '?'))[:12]})"

    # -- what HolderActor asks of a tier --------------------------------------
    def held_keys(self) -> list[bytes]:
        return list(self._blocks)

    def occupancy(self) -> tuple[int, int, int]:
        return len(self._blocks), self._bytes, self.capacity

    def status_line(self) -> str:
        used = f"{fmt_bytes(self._bytes)} / {fmt_bytes(self.capacity)}"
        return f"example_node node={self.node_id[:12]}: {len(self._blocks)} blocks, {used}"

    def describe(self) -> Report:
        return {"node_id": self.node_id}

    def tier_stats(self) -> Report:
        return {"blocks": len(self._blocks), "bytes": self._bytes, "capacity_bytes": self.capacity, **self.counters}

    # -- the storage ----------------------------------------------------------
    def _array(self, region: RegionHandle) -> np.ndarray:
        if region not in self._regions:
            self._regions[region] = MappedRegion(region)
        return self._regions[region].array

    async def store(self, region: RegionHandle, keys: Sequence[bytes], chunk_ids: Sequence[int]) -> StoreAnswer:
        await self._started
        array = self._array(region)
        new = []
        for key, chunk in zip(keys, chunk_ids):
            if key not in self._blocks:
                self._blocks[key] = array[chunk].copy()
                self._bytes += array.shape[1]
                new.append(key)
            self._blocks.move_to_end(key)
        evicted = []
        while self._bytes > self.capacity and self._blocks:
            key, block = self._blocks.popitem(last=False)
            self._bytes -= block.nbytes
            evicted.append(key)
        kept = [k for k in new if k in self._blocks]
        self.log.append(False, kept)
        self.log.append(True, evicted)
        self.counters["stored"] += len(kept)
        self.counters["evicted"] += len(evicted)
        registered, unregistered = self._register(kept), self._unregister(evicted)
        await registered
        await unregistered
        self._publish()
        return StoreAnswer(bytes=len(new) * array.shape[1])

    async def load(
        self, region: RegionHandle, keys: Sequence[bytes], chunk_ids: Sequence[int], deadline: float
    ) -> LoadAnswer:
        await self._started
        if time.time() > deadline:  # the engine gave up on this job: its slots are not ours
            return LoadAnswer(errors=dict.fromkeys(range(len(keys)), "load deadline passed"))
        array = self._array(region)
        ok: list[int] = []
        errors: dict[int, str] = {}
        for i, (key, chunk) in enumerate(zip(keys, chunk_ids)):
            block = self._blocks.get(key)
            if block is None:
                errors[i] = "not held"
            elif block.nbytes != array.shape[1]:
                errors[i] = f"stored block has {block.nbytes} bytes, primary chunks have {array.shape[1]}"
            else:
                array[chunk] = block
                self._blocks.move_to_end(key)
                ok.append(i)
        self.counters["served"] += len(ok)
        self._publish()
        return LoadAnswer(ok=tuple(ok), errors=errors, bytes=len(ok) * array.shape[1])

    async def drop_identities(self, tags: Sequence[bytes]) -> int:
        """Forget every block of these KV identities (``raykv invalidate``)."""
        await self._started
        gone = [k for k in self._blocks if k.startswith(tuple(tags))]
        for key in gone:
            self._bytes -= self._blocks.pop(key).nbytes
        self.log.append(True, gone)
        await self._unregister(gone)
        self._publish()
        return len(gone)


@dataclass
class ExampleNodeOptions:
    namespace: str = namespace_option()
    capacity_bytes: int = bytes_option(256 << 20, min=0, doc="bytes of blocks each node's actor keeps (LRU)")
    job_timeout_s: float = opt(
        30.0, kind=float, min=0.1, max=86400.0, doc="a job whose actor call has not answered by then fails"
    )


class ExampleNodeTier(ActorCallTier):
    """Engine side: one call per job to this node's ``ExampleNodeActor``."""

    Options = ExampleNodeOptions
    medium = PLASMA

    def __init__(
        self,
        primary_kv_view: memoryview,
        tier_type: str,
        options: ExampleNodeOptions,
        services: RaykvServices | None = None,
        identity: KVIdentity | None = None,
        **_: object,
    ) -> None:
        region = describe_region(primary_kv_view)  # ValueError: not a shared-memory region
        super().__init__(primary_kv_view, tier_type, options.namespace, services, identity)
        self.job_timeout_s = options.job_timeout_s
        self.region = dataclasses.replace(region, node_id=self.node_id)
        self.holder_info = holder_info(self.node_id, self.services.namespace)
        ns = self.services.namespace
        self.actor = start_on_node(
            ExampleNodeActor, self.holder_info.actor_name, self.node_id, ns, self.node_id, ns, options.capacity_bytes
        )
        self.start_holder_actor(self.actor, f"{TIER_TYPE} actor of node {self.node_id}", options.capacity_bytes, 120)
        self.liveness = ActorLiveness(
            self.actor, f"{TIER_TYPE} actor of node {self.node_id}", name=self.holder_info.actor_name, namespace=ns
        )

    def can_load(self, holder: HolderInfo) -> bool:
        return holder.holder_id == self.holder_info.holder_id and self.holder_alive

    def submit_store(self, job: TransferJob) -> None:
        self.send_job("store", job, lambda keys, chunks: self.actor.store.remote(self.region, keys, chunks))

    def submit_load(self, job: TransferJob) -> None:
        self.send_job(
            "load", job, lambda keys, chunks: self.actor.load.remote(self.region, keys, chunks, self.load_deadline())
        )

    def shutdown(self) -> None:
        """Fail what is in flight; the node's actor and its blocks live on."""
        self.close_calls()
