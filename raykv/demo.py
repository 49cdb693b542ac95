"""``raykv demo``: raykv on an embedded local Ray with two simulated nodes.

Two "engine" replicas (Ray actors, one per node) serve a multi-turn,
shared-prefix workload round-robin. Each replica computes the KV blocks it
misses (deterministic bytes standing in for attention KV) and offloads them;
with raykv, a replica finds blocks that the *other* replica computed through
the directory and loads them (plasma across nodes, or the shared fs tier)
instead of recomputing. The baseline is a per-replica cache only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import ray

BLOCK_TOKENS = 16
BLOCK_BYTES = 256 * 1024
NUM_CHUNKS = 512


def block_bytes(key: bytes) -> np.ndarray:
    """The 'KV' of a block: deterministic in its key, so loads can be verified."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


@ray.remote(num_cpus=0)
class DemoEngine:
    """A stand-in engine replica with a primary region and raykv tiers."""

    def __init__(self, namespace: str, fs_root: str, use_raykv: bool) -> None:
        from raykv.client import TierDriver
        from raykv.factory import TierFactory
        from raykv.primary import PrimaryRegion

        self.region = PrimaryRegion(NUM_CHUNKS, BLOCK_BYTES)
        self.local: set[bytes] = set()  # the replica's own cache (keys it computed)
        self.use_raykv = use_raykv
        self.tiers = []
        if use_raykv:
            for cfg in (
                {"type": "object_store", "namespace": namespace},
                {"type": "fs", "namespace": namespace, "root": fs_root},
            ):
                self.tiers.append(TierDriver(TierFactory.create_tier(cfg, self.region.view)))
        self.next_chunk = 0

    def _slot(self) -> int:
        self.next_chunk = (self.next_chunk + 1) % NUM_CHUNKS
        return self.next_chunk

    def serve(self, keys: list[bytes]) -> dict[str, Any]:
        """Serve one request's prefix blocks; returns hit counts and timing."""
        from raykv.contract import LookupResult

        t0 = time.perf_counter()
        hits = remote_hits = 0
        computed: list[tuple[bytes, int]] = []
        ok = True
        for i, key in enumerate(keys):
            if key in self.local:
                hits += 1
                continue
            loaded = False
            for drv in self.tiers:
                if drv.lookup([key])[0] is LookupResult.HIT:
                    slot = self._slot()
                    if drv.load([key], [slot]).success:
                        ok &= bool(np.array_equal(self.region.array[slot], block_bytes(key)))
                        loaded = True
                        break
            if loaded:
                hits += 1
                remote_hits += 1
                self.local.add(key)
                continue
            slot = self._slot()
            self.region.array[slot] = block_bytes(key)  # "compute" the block
            time.sleep(0.002)  # prefill cost of a block, kept small for the demo
            computed.append((key, slot))
            self.local.add(key)
        if self.tiers and computed:
            ks, slots = zip(*computed)
            self.tiers[0].store(list(ks), list(slots))
            self.tiers[1].store(list(ks), list(slots))
        return {"hits": hits, "remote_hits": remote_hits, "blocks": len(keys),
                "ms": (time.perf_counter() - t0) * 1000, "ok": ok}


def _workload(n_conversations: int, turns: int) -> list[list[bytes]]:
    from raykv.keys import prefix_keys

    rng = np.random.default_rng(7)
    system = list(rng.integers(0, 32000, BLOCK_TOKENS * 8))
    requests = []
    for c in range(n_conversations):
        history = list(system)
        for _ in range(turns):
            history += list(rng.integers(0, 32000, BLOCK_TOKENS * 2))
            requests.append(prefix_keys(history, BLOCK_TOKENS))
    return requests


def _run(namespace: str, fs_root: str, node_resources: list[str], use_raykv: bool) -> dict[str, Any]:
    engines = [
        DemoEngine.options(resources={res: 0.001}).remote(namespace, fs_root, use_raykv)
        for res in node_resources
    ]
    results = []
    from tqdm import tqdm

    reqs = _workload(6, 4)
    for i, keys in enumerate(tqdm(reqs, desc="raykv" if use_raykv else "per-replica", leave=False)):
        results.append(ray.get(engines[i % len(engines)].serve.remote(keys)))
    for e in engines:
        ray.kill(e)
    ms = sorted(r["ms"] for r in results)
    return {
        "requests": len(results),
        "hit_blocks": sum(r["hits"] for r in results),
        "cross_replica_hits": sum(r["remote_hits"] for r in results),
        "blocks": sum(r["blocks"] for r in results),
        "p50_ms": ms[len(ms) // 2],
        "ok": all(r["ok"] for r in results),
    }


def run_demo(args: argparse.Namespace) -> int:
    from ray.cluster_utils import Cluster

    import raykv

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node0": 1}})
    cluster.add_node(num_cpus=1, resources={"node1": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="raykv-demo-") as root:
            raykv.start({"namespace": "raykv-demo"})
            base = _run("raykv-demo", root, ["node0", "node1"], use_raykv=False)
            with_raykv = _run("raykv-demo", root, ["node0", "node1"], use_raykv=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary = {
        "replicas": 2,
        "requests": base["requests"],
        "baseline_hit_blocks": base["hit_blocks"],
        "raykv_hit_blocks": with_raykv["hit_blocks"],
        "raykv_cross_replica_hits": with_raykv["cross_replica_hits"],
        "baseline_p50_ms": round(base["p50_ms"], 2),
        "raykv_p50_ms": round(with_raykv["p50_ms"], 2),
        "outputs_match": base["ok"] and with_raykv["ok"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{'':<28}{'per-replica cache':>20}{'raykv':>12}")
        print(f"{'prefix blocks hit':<28}{base['hit_blocks']:>20}{with_raykv['hit_blocks']:>12}")
        print(f"{'  of them from the other node':<28}{0:>20}{with_raykv['cross_replica_hits']:>12}")
        print(f"{'request p50 (ms)':<28}{base['p50_ms']:>20.1f}{with_raykv['p50_ms']:>12.1f}")
        print(f"{'loaded bytes verified':<28}{str(base['ok']):>20}{str(with_raykv['ok']):>12}")
    return 0 if summary["outputs_match"] else 1
