"""Micro-benchmark: the object store tier vs a numpy memcpy of the same bytes.

    python -m tiers.object_store.bench --blocks 32 --block-mib 2
    python -m tiers.object_store.bench --cross-node      # store on node A, load on node B
    python -m tiers.object_store.bench --preallocate     # RAY_preallocate_plasma_memory=1

On a fresh local Ray it times, for ``--rounds`` rounds of ``--blocks`` new
blocks (strided chunk ids, so nothing coalesces):

- memcpy: ``np.copyto`` of each block from the source region to the destination
  region (the floor any copy path pays once);
- ray.put strategies (from the driver): one ``ray.put`` of the blocks as block
  views, as a gathered array, and as <= 1 MiB pieces (what the tier does);
- tier store / load: ``TierDriver`` jobs (actor call, mapping, put, directory
  registration / get + copy into the primary, ``JobResult`` via ``poll_jobs``),
  and the part the actor itself reports.

The capacity is 4 jobs, so steady-state rounds include LRU eviction. Medians
are over the second half of the rounds: the first pass over the plasma arena
pays page faults (see README.md); the first round is shown too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

MiB = 1024 * 1024


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s ({seconds * 1000:7.2f} ms)"


def _median(xs: list[float]) -> float:
    """Steady state: the median of the second half of the rounds (the first
    rounds fault fresh plasma pages in, see README.md)."""
    return statistics.median(xs[len(xs) // 2 :])


def bench_put_strategies(src: np.ndarray, chunks: list[int], rounds: int) -> None:
    import ray

    from tiers.object_store import packing

    nbytes = len(chunks) * src.shape[1]
    flat = src.reshape(-1)
    plan = packing.plan_pieces(chunks, src.shape[1])
    variants = {
        "ray.put list of block views": lambda: ray.put([src[c] for c in chunks]),
        "ray.put gathered array": lambda: ray.put(src[chunks]),
        "ray.put <=1 MiB pieces (tier)": lambda: ray.put(packing.piece_views(flat, plan)),
    }
    for name, put in variants.items():
        keep, times = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            keep.append(put())
            times.append(time.perf_counter() - t0)
            keep = keep[-4:]
        print(f"  {name:32s} {_gbps(nbytes, _median(times))}")


def bench_one_node(args: argparse.Namespace) -> None:
    import ray

    import raykv
    from raykv.client import TierDriver
    from raykv.factory import TierFactory
    from raykv.primary import PrimaryRegion

    block = int(args.block_mib * MiB)
    n = args.blocks
    arena = max(512 * MiB, 8 * n * block)
    # Each process faults a plasma page in the first time it touches it, and
    # plasma's allocator walks the whole arena before reusing memory: run
    # enough rounds that the second half sees a warm arena.
    args.rounds = args.rounds or max(20, -(-3 * arena // (n * block)))
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=arena,
        include_dashboard=False,
        log_to_driver=False,
    )
    services = raykv.start({"namespace": "raykv-bench", "directory_shards": 2})
    src = PrimaryRegion(2 * n, block)
    dst = PrimaryRegion(2 * n, block)
    src.array[:] = np.random.default_rng(0).integers(0, 256, src.array.shape, dtype=np.uint8)
    dst.array[:] = 1  # fault the pages in, as a live engine's primary would be
    chunks = list(range(0, 2 * n, 2))
    nbytes = n * block
    print(f"{n} blocks x {args.block_mib:g} MiB = {nbytes / MiB:.0f} MiB per job, {args.rounds} rounds, "
          "medians of the last half")

    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for i, c in enumerate(chunks):
            np.copyto(dst.array[i], src.array[c])
        times.append(time.perf_counter() - t0)
    print(f"  {'numpy memcpy (per block)':32s} {_gbps(nbytes, _median(times))}")
    bench_put_strategies(src.array, chunks, args.rounds)

    tier = TierFactory.create_tier(
        {"type": "object_store", "capacity_bytes": 4 * nbytes}, src.view, services=services
    )
    reader = TierFactory.create_tier({"type": "object_store"}, dst.view, services=services)
    store_t, load_t = [], []
    for r in range(args.rounds):
        keys = raykv.prefix_keys(list(range(r * 10_000, r * 10_000 + n)), 1)
        t0 = time.perf_counter()
        res = TierDriver(tier).store(keys, chunks)
        store_t.append(time.perf_counter() - t0)
        assert res.success, res.error
        reader.lookup_blocking(keys)
        t0 = time.perf_counter()
        res = TierDriver(reader).load(keys, list(range(n)))
        load_t.append(time.perf_counter() - t0)
        assert res.success, res.error
        assert all(np.array_equal(dst.array[i], src.array[c]) for i, c in enumerate(chunks[:2]))
    stats = tier.stats()
    print(f"  {'tier store job':32s} {_gbps(nbytes, _median(store_t))}  first round {store_t[0] * 1000:.0f} ms")
    print(f"  {'tier load job (same node)':32s} {_gbps(nbytes, _median(load_t))}  first round {load_t[0] * 1000:.0f} ms")
    print(
        f"  inside the actor (p50 of last 64): store {stats['store_ms_p50']:.2f} ms of which ray.put "
        f"{stats['put_ms_p50']:.2f} ms; load {stats['load_ms_p50']:.2f} ms"
    )
    print(
        f"  actor: {stats['blocks']} blocks, {stats['bytes_used'] / MiB:.0f} MiB / "
        f"{stats['capacity_bytes'] / MiB:.0f} MiB, {stats['evictions']} evicted"
    )
    tier.shutdown()
    reader.shutdown()
    services.shutdown()
    ray.shutdown()


def bench_cross_node(args: argparse.Namespace) -> None:
    import ray
    from ray.cluster_utils import Cluster

    import raykv

    block = int(args.block_mib * MiB)
    n = args.blocks
    plasma = max(512 * MiB, 6 * n * block)
    args.rounds = args.rounds or max(20, -(-3 * plasma // (n * block)))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": plasma, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=plasma)
    ray.init(address=cluster.address, log_to_driver=False)
    services = raykv.start({"namespace": "raykv-bench-2", "directory_shards": 2})

    @ray.remote(num_cpus=0)
    class Engine:
        def __init__(self) -> None:
            from raykv.factory import TierFactory
            from raykv.primary import PrimaryRegion

            self.region = PrimaryRegion(n, block)
            self.region.array[:] = np.random.default_rng(1).integers(0, 256, self.region.array.shape, dtype=np.uint8)
            self.tier = TierFactory.create_tier(
                {"type": "object_store", "capacity_bytes": 4 * n * block}, self.region.view,
                services=raykv.attach("raykv-bench-2"),
            )

        def store(self, r: int) -> float:
            from raykv.client import TierDriver

            keys = raykv.prefix_keys(list(range(r * 10_000, r * 10_000 + n)), 1)
            t0 = time.perf_counter()
            assert TierDriver(self.tier).store(keys, list(range(n))).success
            return time.perf_counter() - t0

        def load(self, r: int) -> float:
            from raykv.client import TierDriver

            keys = raykv.prefix_keys(list(range(r * 10_000, r * 10_000 + n)), 1)
            self.tier.lookup_blocking(keys)
            t0 = time.perf_counter()
            res = TierDriver(self.tier).load(keys, list(range(n)))
            assert res.success, res.error
            return time.perf_counter() - t0

    a = Engine.options(resources={"node_a": 0.01}).remote()
    b = Engine.options(resources={"node_b": 0.01}).remote()
    store_t, load_t = [], []
    for r in range(args.rounds):
        store_t.append(ray.get(a.store.remote(r)))
        load_t.append(ray.get(b.load.remote(r)))
    nbytes = n * block
    print(f"two nodes on one host, {n} x {args.block_mib:g} MiB per job, {args.rounds} rounds, medians")
    print(f"  {'tier store job (node A)':32s} {_gbps(nbytes, _median(store_t))}  first round {store_t[0] * 1000:.0f} ms")
    print(f"  {'tier load job (node B pulls)':32s} {_gbps(nbytes, _median(load_t))}  first round {load_t[0] * 1000:.0f} ms")
    services.shutdown()
    ray.shutdown()
    cluster.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=0, help="0: enough to cycle the plasma arena 3 times")
    p.add_argument("--cross-node", action="store_true", help="two local Ray nodes: store on A, load on B")
    p.add_argument(
        "--preallocate",
        action="store_true",
        help="start Ray with RAY_preallocate_plasma_memory=1 (plasma pages faulted in at startup)",
    )
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.preallocate:
        os.environ["RAY_preallocate_plasma_memory"] = "1"
    (bench_cross_node if args.cross_node else bench_one_node)(args)


if __name__ == "__main__":
    main()
