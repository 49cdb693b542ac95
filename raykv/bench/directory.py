"""``raykv bench directory``: batched prefix lookups against directory shards.

On an embedded local Ray, for each shard count it starts a fresh directory,
registers random 36-byte offload keys (32-byte hash + 4-byte group index, as
vLLM's) for one holder up to each stored-key count, and after each count:

- ``bytes_per_key``: the growth of the shard actors' private resident memory
  (``RssAnon``, summed over the shards) while the keys were registered, per key;
- for each call size, ``--calls`` sequential ``DirectoryClient.prefix_lookup``
  calls of keys drawn at random from the stored ones (every key is a hit: the
  most work a call can do): ``lookup_p50_ms`` / ``lookup_p99_ms`` per call and
  ``lookup_keys_per_s`` (keys answered per second by one caller);
- ``lookup_keys_per_s_pipelined`` (100k-key calls): ``--pipeline`` calls in
  flight at once from the same caller, so the shards rather than the caller's
  round trips set the pace.

A call is the real client path: split by shard in the caller, one actor call
per shard, shard lookup, per-key holders merged back, the leading run of held
keys with each key's preferred holder.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from typing import Any

from raykv.bench.common import (
    Progress,
    machine,
    median,
    percentile,
    ratio,
    table,
    target,
    targets_table,
)

HELP = "batched prefix lookups: keys/s, p50/p99 per call and bytes per key, for 1/2/4 shards"

KEY_BYTES = 36
REGISTER_BATCH = 100_000
#: Keep one query key in this many registered ones (bounds the caller's memory).
POOL_MAX = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", default=None, help="stored-key counts, comma-separated, ascending (default 1M,10M; quick 20k)")
    p.add_argument("--call-sizes", default=None, help="keys per lookup call (default 1k,100k; quick 1k,10k)")
    p.add_argument("--shards", default=None, help="shard counts (default 1,2,4; quick 1,2)")
    p.add_argument("--calls", type=int, default=None, help="timed calls per configuration (default: ~2M keys' worth, 30..400)")
    p.add_argument("--pipeline", type=int, default=4, help="calls in flight for the pipelined throughput")


def parse_count(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    return {
        "quick": quick,
        "keys": sorted(parse_count(k) for k in (args.keys or ("20k" if quick else "1M,10M")).split(",")),
        "call_sizes": [parse_count(c) for c in (args.call_sizes or ("1k,10k" if quick else "1k,100k")).split(",")],
        "shards": [int(x) for x in (args.shards or ("1,2" if quick else "1,2,4")).split(",")],
        "calls": args.calls,
        "pipeline": args.pipeline,
        "progress": not getattr(args, "no_progress", False),
    }


def _holder_class() -> Any:
    import ray

    from raykv.tier_base import WatchableActor

    @ray.remote(num_cpus=0)
    class BenchHolder(WatchableActor):
        """A holder for the directory to watch (its keys are registered by the driver)."""

    return BenchHolder


def _rss(shards: list[Any]) -> int:
    """Summed private resident memory (``RssAnon``: the heap, not the plasma
    pages that arguments are read from) of the shard actors, after a GC in each."""
    import ray

    def rss(_self: Any) -> int:
        import gc as _gc

        _gc.collect()
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        import psutil  # no RssAnon (not Linux): all resident memory

        return psutil.Process().memory_info().rss

    return sum(ray.get([s.__ray_call__.remote(rss) for s in shards]))


def _calls_for(size: int, wanted: int | None, quick: bool) -> int:
    if wanted:
        return wanted
    if quick:
        return 20
    return max(30, min(400, 2_000_000 // size))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    s = _settings(args)
    at_start = machine()  # before the run loads the machine
    import ray

    import raykv
    from raykv.directory.holders import SHARED, HolderInfo

    max_keys = max(s["keys"])
    arg_bytes = max(s["call_sizes"]) * KEY_BYTES * (s["pipeline"] + 2) + REGISTER_BATCH * KEY_BYTES * 8
    ray.init(
        address="local", num_cpus=2, object_store_memory=max(256 << 20, 4 * arg_bytes),
        include_dashboard=False, log_to_driver=False,
    )
    steps = len(s["shards"]) * (max_keys // REGISTER_BATCH + 1 + len(s["keys"]) * (len(s["call_sizes"]) + 1))
    progress = Progress(steps, "directory", s["progress"])
    configs: dict[str, Any] = {}
    rng = random.Random(0)
    stride = max(1, -(-max_keys // POOL_MAX))
    try:
        holder_cls = _holder_class()
        for shards in s["shards"]:
            ns = f"raykv-bench-directory-{shards}"
            services = raykv.start({"namespace": ns, "directory_shards": shards})
            directory = services.directory
            holder = holder_cls.remote()
            info = HolderInfo("bench:holder", "bench", SHARED, "raykv-bench-holder", ns, None)
            ray.get(directory.add_holder(info, holder))
            rss0 = _rss(directory.shards)
            pool: list[bytes] = []
            stored = 0
            for count in s["keys"]:
                inflight: list[Any] = []
                while stored < count:
                    n = min(REGISTER_BATCH, count - stored)
                    blob = os.urandom(n * KEY_BYTES)
                    keys = [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]
                    pool.extend(keys[::stride])
                    inflight.append(directory.register(info.holder_id, keys))
                    if len(inflight) >= 4:  # keep the shards busy while we build the next batch
                        ray.get(inflight.pop(0))
                    stored += n
                    progress.step(f"{shards} shards: registering {stored:,}")
                for refs in inflight:
                    ray.get(refs)
                del keys, blob, inflight
                gc.collect()
                held = sum(st["keys"] for st in directory.stats())
                rss = _rss(directory.shards)
                entry: dict[str, Any] = {
                    "shards": shards,
                    "stored_keys": count,
                    "directory_keys": held,
                    "shard_rss_bytes": rss,
                    "bytes_per_key": (rss - rss0) / count,
                    "calls": {},
                }
                for size in s["call_sizes"]:
                    entry["calls"][str(size)] = _lookups(directory, pool, size, _calls_for(size, s["calls"], s["quick"]), rng)
                    progress.step(f"{shards} shards, {count:,} keys, calls of {size:,}")
                big = max(s["call_sizes"])
                entry["lookup_keys_per_s_pipelined"] = _pipelined(directory, pool, big, s["pipeline"], rng, s["quick"])
                progress.step()
                configs[f"shards={shards},keys={count}"] = entry
            services.shutdown()
            ray.kill(holder)
            del pool
            gc.collect()
    finally:
        progress.close()
        ray.shutdown()
    result = {
        "benchmark": "directory",
        "config": {k: v for k, v in s.items() if k != "progress"} | {"key_bytes": KEY_BYTES},
        "machine": {**at_start, "loadavg_1m_at_end": machine()["loadavg_1m"]},
        "configs": configs,
        "rows": [
            {
                "shards": c["shards"], "stored_keys": c["stored_keys"], "call_keys": int(size),
                **{k: m[k] for k in ("lookup_keys_per_s", "lookup_p50_ms", "lookup_p99_ms")},
                "bytes_per_key": c["bytes_per_key"],
            }
            for c in configs.values()
            for size, m in c["calls"].items()
        ],
    }
    result["targets"] = _targets(result)
    return result


def _lookups(directory: Any, pool: list[bytes], size: int, calls: int, rng: random.Random) -> dict[str, Any]:
    """Sequential prefix lookups of ``size`` stored keys: latency and keys/s."""
    batches = [rng.sample(pool, size) if size <= len(pool) else rng.choices(pool, k=size) for _ in range(calls + 2)]
    lat: list[float] = []
    misses = 0
    for i, keys in enumerate(batches):
        t0 = time.perf_counter()
        hit = directory.prefix_lookup(keys)
        dt = time.perf_counter() - t0
        misses += size - hit.num_keys
        if i >= 2:  # two warm-up calls
            lat.append(dt)
    return {
        "calls": len(lat),
        "lookup_keys_per_s": size * len(lat) / sum(lat),
        "lookup_p50_ms": percentile(lat, 50) * 1e3,
        "lookup_p99_ms": percentile(lat, 99) * 1e3,
        "lookup_mean_ms": sum(lat) / len(lat) * 1e3,
        "misses": misses,
    }


def _pipelined(directory: Any, pool: list[bytes], size: int, depth: int, rng: random.Random, quick: bool) -> float:
    """Keys/s with ``depth`` batched lookups in flight (one caller)."""
    from raykv.directory.client import prefix_of

    rounds = 2 if quick else 5
    batches = [rng.sample(pool, min(size, len(pool))) for _ in range(depth * rounds)]
    rates = []
    for r in range(rounds):
        group = batches[r * depth : (r + 1) * depth]
        t0 = time.perf_counter()
        pending = [directory.lookup_async(keys) for keys in group]
        for p in pending:
            prefix_of(p.result(30.0), None)
        rates.append(sum(len(k) for k in group) / (time.perf_counter() - t0))
    return median(rates)


def _targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    cfgs = result["configs"]
    sizes = result["config"]["call_sizes"]
    big, small = str(max(sizes)), str(min(sizes))
    one = [c for c in cfgs.values() if c["shards"] == 1]
    if one:
        worst = min(one, key=lambda c: c["calls"][big]["lookup_keys_per_s"])
        out.append(target(
            f"keys/s of one shard, {int(big):,}-key calls (worst stored count)",
            worst["calls"][big]["lookup_keys_per_s"], 1e6,
            detail=", ".join(f"{c['stored_keys']:,} keys: {c['calls'][big]['lookup_keys_per_s']:,.0f}" for c in one),
        ))
    p99 = {k: c["calls"][small]["lookup_p99_ms"] for k, c in cfgs.items()}
    if p99:
        worst_k = max(p99, key=lambda k: p99[k])
        out.append(target(f"p99 of a {int(small):,}-key call, ms (worst config)", p99[worst_k], 5.0, higher_is_better=False, detail=worst_k))
    bpk = {k: c["bytes_per_key"] for k, c in cfgs.items()}
    if bpk:
        worst_k = max(bpk, key=lambda k: bpk[k])
        out.append(target("directory bytes per key (worst config)", bpk[worst_k], 200.0, higher_is_better=False, detail=worst_k))
    for count in result["config"]["keys"]:
        row = sorted((c["shards"], c) for c in cfgs.values() if c["stored_keys"] == count)
        if len(row) < 2:
            continue
        for metric, label in (("seq", "sequential"), ("pipe", "pipelined")):
            vals = [
                (n, c["calls"][big]["lookup_keys_per_s"] if metric == "seq" else c["lookup_keys_per_s_pipelined"])
                for n, c in row
            ]
            growth = ratio(vals[-1][1], vals[0][1])
            out.append(target(
                f"keys/s {vals[-1][0]} shards / 1 shard, {label} {int(big):,}-key calls, {count:,} keys",
                growth, 1.0, detail=", ".join(f"{n}: {v:,.0f}" for n, v in vals),
            ))
    return out


def format_result(result: dict[str, Any]) -> str:
    cfg = result["config"]
    rows = []
    for c in result["configs"].values():
        for size, m in c["calls"].items():
            rows.append([
                c["shards"], f"{c['stored_keys']:,}", f"{int(size):,}", m["lookup_keys_per_s"],
                m["lookup_p50_ms"], m["lookup_p99_ms"], c["bytes_per_key"],
                c["lookup_keys_per_s_pipelined"] if size == str(max(cfg["call_sizes"])) else None,
            ])
    parts = [
        f"directory: {cfg['key_bytes']}-byte keys, one caller; pipelined = {cfg['pipeline']} calls in flight",
        table(
            ("shards", "stored keys", "keys/call", "keys/s", "p50 ms", "p99 ms", "bytes/key", "keys/s pipelined"),
            rows,
        ),
        "\n" + targets_table(result["targets"]),
    ]
    return "\n".join(parts)
