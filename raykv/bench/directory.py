"""``raykv bench directory``: batched prefix lookups against directory shards.

On an embedded local Ray, for each shard count it starts a fresh directory,
registers random 44-byte identity-scoped keys (an 8-byte identity tag + a
32-byte hash + 4-byte group index, as raykv stores vLLM's keys) for one holder
up to each stored-key count (``register_keys_per_s``: sequential 100k-key
register calls from one caller), and after each count:

- ``bytes_per_key``: the growth of the shard actors' private resident memory
  (``RssAnon``, summed over the shards) while the keys were registered, per key;
- for each call size, ``--calls`` sequential ``DirectoryClient.prefix_lookup``
  calls of keys drawn at random from the stored ones (every key is a hit: the
  most work a call can do): ``lookup_p50_ms`` / ``lookup_p99_ms`` per call and
  ``lookup_keys_per_s`` (keys answered per second by one caller);
- ``lookup_keys_per_s_pipelined`` (100k-key calls): ``--pipeline`` calls in
  flight at once from the same caller, so the shards rather than the caller's
  round trips set the pace;
- ``shard_cpu_us_per_key``: CPU time of the shard processes (every thread:
  Ray's deserialisation included) per key looked up, per call size;
- ``floor`` (per shard count): the p50/p99 of a no-op call to one shard
  (``ping``) and of a 1-key lookup, and the shard's CPU per ping: the per-call
  cost that no per-key work is in.

Then, on one shard at the largest stored count, ``--clients`` simulated
engine clients (actors, each its own holder) run a step loop for
``--seconds``: look up ``--step-lookups`` keys (half stored, half never
stored), register ``--step-registers`` new keys and unregister as many old
ones. Reported: keys/s over all clients, the shard's CPU time per key, and the
p50/p99 of one client step (its three calls).

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
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ray.actor import ActorHandle

from raykv.bench import agents
from raykv.bench.common import (
    Progress,
    above_zero,
    as_json,
    at_least,
    counts_option,
    entries,
    machine,
    median,
    num,
    number,
    percentile,
    random_keys,
    ratio,
    section,
    table,
    target,
    targets_table,
)
from raykv.core import signals
from raykv.core.validate import ArgumentError
from raykv.core.wire import JsonValue, Report

if TYPE_CHECKING:
    from raykv.directory.client import DirectoryClient
    from raykv.services.cluster import RaykvServices

HELP = "batched prefix lookups: keys/s, p50/p99 per call and bytes per key, for 1/2/4 shards"

KEY_BYTES = 44  # identity tag (8) + block hash (32) + group index (4)
TAG = bytes.fromhex("5ca1ab1e0ddba11c")
REGISTER_BATCH = 100_000
#: Keep one query key in this many registered ones (bounds the caller's memory).
POOL_MAX = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys", default=None, help="stored-key counts, comma-separated, ascending (default 1M,10M; quick 20k)"
    )
    p.add_argument("--call-sizes", default=None, help="keys per lookup call (default 1k,100k; quick 1k,10k)")
    p.add_argument("--shards", default=None, help="shard counts (default 1,2,4; quick 1,2)")
    p.add_argument(
        "--calls", type=int, default=None, help="timed calls per configuration (default: ~2M keys' worth, 30..400)"
    )
    p.add_argument("--pipeline", type=int, default=4, help="calls in flight for the pipelined throughput")
    p.add_argument(
        "--clients", type=int, default=None, help="simulated engine clients on one shard (default 8; quick 2; 0: skip)"
    )
    p.add_argument(
        "--seconds", type=float, default=None, help="duration of the concurrent-clients run (default 20; quick 3)"
    )
    p.add_argument("--step-lookups", type=int, default=512, help="keys each client looks up per step")
    p.add_argument("--step-registers", type=int, default=64, help="keys each client registers (and evicts) per step")
    p.add_argument(
        "--nodes", type=int, default=None, help="simulated nodes for the agents run (default 2; quick 1; 0: skip)"
    )
    p.add_argument("--engines-per-node", type=int, default=None, help="engines per simulated node (default 8; quick 2)")
    p.add_argument("--agent-seconds", type=float, default=None, help="each agents-run config's duration (default 20)")
    p.add_argument("--agents-only", action="store_true", help="run only the node-agents part")


def parse_count(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


@dataclass(frozen=True)
class Settings:
    """What one run measures (its ``config`` in the report, but ``progress``)."""

    quick: bool
    keys: list[int]
    call_sizes: list[int]
    shards: list[int]
    calls: int | None
    pipeline: int
    clients: int
    seconds: float
    step_lookups: int
    step_registers: int
    nodes: int
    engines_per_node: int
    agent_seconds: float
    agents_only: bool
    progress: bool


class ClientRun(NamedTuple):
    """A simulated engine's answer to ``run``: its step times and the keys it touched."""

    steps: list[float]
    keys: int


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(getattr(args, "quick", False))
    at_least(1, calls=args.calls, pipeline=args.pipeline, step_lookups=args.step_lookups)
    at_least(0, step_registers=args.step_registers, clients=args.clients, nodes=getattr(args, "nodes", None))  # 0: skip
    at_least(1, engines_per_node=getattr(args, "engines_per_node", None))
    if getattr(args, "agents_only", False) and getattr(args, "nodes", None) == 0:
        raise ArgumentError("--nodes", "--agents-only runs only the node-agents part: give at least 1 node")
    above_zero(seconds=args.seconds, agent_seconds=getattr(args, "agent_seconds", None))
    return Settings(
        quick=quick,
        keys=sorted(counts_option("--keys", args.keys or ("20k" if quick else "1M,10M"), parse_count)),
        call_sizes=counts_option("--call-sizes", args.call_sizes or ("1k,10k" if quick else "1k,100k"), parse_count),
        shards=counts_option("--shards", args.shards or ("1,2" if quick else "1,2,4")),
        calls=args.calls,
        pipeline=args.pipeline,
        clients=args.clients if args.clients is not None else (2 if quick else 8),
        seconds=args.seconds or (3.0 if quick else 20.0),
        step_lookups=args.step_lookups,
        step_registers=args.step_registers,
        nodes=int(args.nodes) if getattr(args, "nodes", None) is not None else (1 if quick else 2),
        engines_per_node=getattr(args, "engines_per_node", None) or (2 if quick else 8),
        agent_seconds=getattr(args, "agent_seconds", None) or (2.0 if quick else 20.0),
        agents_only=bool(getattr(args, "agents_only", False)),
        progress=not getattr(args, "no_progress", False),
    )


def _holder_class() -> Any:  # a Ray actor class (Ray's stubs type it as the Python class)
    import ray

    from raykv.holders.holder_actor import WatchableActor

    @ray.remote(num_cpus=0)
    class BenchHolder(WatchableActor):
        """A holder for the directory to watch (its keys are registered by the driver)."""

    return BenchHolder


def _rss(shards: list[ActorHandle]) -> int:
    """Summed private resident memory (``RssAnon``: the heap, not the plasma
    pages that arguments are read from) of the shard actors, after a GC in each."""
    import ray

    def rss(_self: object) -> int:
        import gc as _gc

        _gc.collect()
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        import psutil  # no RssAnon (not Linux): all resident memory

        return psutil.Process().memory_info().rss

    return sum(ray.get([s.__ray_call__.remote(rss) for s in shards]))


def _cpu(shards: list[ActorHandle]) -> float:
    """Summed CPU seconds (user + system, all threads) of the shard processes."""
    import ray

    def cpu(_self: object) -> float:
        return time.process_time()

    return sum(ray.get([s.__ray_call__.remote(cpu) for s in shards]))


def _keys(n: int) -> list[bytes]:
    """``n`` random identity-scoped keys."""
    return random_keys(n, TAG, KEY_BYTES)


def _calls_for(size: int, wanted: int | None, quick: bool) -> int:
    if wanted:
        return wanted
    if quick:
        return 20
    return max(30, min(400, 2_000_000 // size))


def run(args: argparse.Namespace) -> Report:
    """Run the benchmark; returns the JSON result."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    s = _settings(args)
    at_start = machine()  # before the run loads the machine
    import ray

    import raykv
    from raykv.core.placement import SHARED, HolderInfo

    max_keys = max(s.keys)
    arg_bytes = max(s.call_sizes) * KEY_BYTES * (s.pipeline + 2) + REGISTER_BATCH * KEY_BYTES * 8
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=max(256 << 20, 4 * arg_bytes),
        include_dashboard=False,
        log_to_driver=False,
    )
    signals.after_ray_init()
    steps = len(s.shards) * (max_keys // REGISTER_BATCH + 1 + len(s.keys) * (len(s.call_sizes) + 1)) + 1
    progress = Progress(steps, "directory", s.progress)
    configs: dict[str, Report] = {}
    rows: list[dict[str, float]] = []  # per config and call size: the headline figures
    concurrent: Report | None = None
    rng = random.Random(0)
    stride = max(1, -(-max_keys // POOL_MAX))
    try:
        holder_cls = _holder_class()
        for shards in [] if s.agents_only else s.shards:
            ns = f"raykv-bench-directory-{shards}"
            services = raykv.start({"namespace": ns, "directory_shards": shards})
            directory = services.directory
            holder = holder_cls.remote()
            info = HolderInfo("bench:holder", "bench", SHARED, "raykv-bench-holder", ns, None)
            ray.get(directory.add_holder(info, holder))
            rss0 = _rss(directory.shards)
            floor: dict[str, float] | None = None
            pool: list[bytes] = []
            stored = 0
            for count in s.keys:
                reg_s = 0.0
                reg_n = 0
                cpu0 = _cpu(directory.shards)
                while stored < count:
                    keys = _keys(min(REGISTER_BATCH, count - stored))
                    pool.extend(keys[::stride])
                    t0 = time.perf_counter()
                    ray.get(directory.register(info.holder_id, keys))
                    reg_s += time.perf_counter() - t0
                    reg_n += len(keys)
                    stored += len(keys)
                    progress.step(f"{shards} shards: registering {stored:,}")
                reg_cpu = _cpu(directory.shards) - cpu0
                keys = []
                gc.collect()
                held = sum(st.keys for st in directory.stats())
                rss = _rss(directory.shards)
                calls: dict[str, dict[str, float]] = {}
                entry: Report = {
                    "shards": shards,
                    "stored_keys": count,
                    "directory_keys": held,
                    "shard_rss_bytes": rss,
                    "bytes_per_key": (rss - rss0) / count,
                    "register_keys_per_s": reg_n / reg_s if reg_s else None,
                    "register_cpu_us_per_key": reg_cpu / reg_n * 1e6 if reg_n else None,
                }
                for size in s.call_sizes:
                    cpu0 = _cpu(directory.shards)
                    m = _lookups(directory, pool, size, _calls_for(size, s.calls, s.quick), rng)
                    m["shard_cpu_us_per_key"] = (_cpu(directory.shards) - cpu0) / (size * (m["calls"] + 2)) * 1e6
                    calls[str(size)] = m
                    progress.step(f"{shards} shards, {count:,} keys, calls of {size:,}")
                entry["calls"] = as_json(calls)
                for size_label, m in calls.items():
                    figures = {k: m[k] for k in ("lookup_keys_per_s", "lookup_p50_ms", "lookup_p99_ms")}
                    rows.append(
                        {
                            "shards": shards,
                            "stored_keys": count,
                            "call_keys": int(size_label),
                            **figures,
                            "bytes_per_key": (rss - rss0) / count,
                        }
                    )
                if floor is None:
                    floor = _floor(directory, pool, 50 if s.quick else 300)
                entry["floor"] = as_json(floor)
                big = max(s.call_sizes)
                entry["lookup_keys_per_s_pipelined"] = _pipelined(directory, pool, big, s.pipeline, rng, s.quick)
                progress.step()
                configs[f"shards={shards},keys={count}"] = entry
            if shards == 1 and s.clients > 0:
                progress.step(f"1 shard: {s.clients} concurrent clients")
                concurrent = _concurrent(services, pool, s)
            services.shutdown()
            ray.kill(holder)
            del pool
            gc.collect()
    finally:
        progress.close()
        ray.shutdown()
    agent_run: Report | None = None
    if s.nodes > 0:
        agent_run = agents.run_section(s.nodes, s.engines_per_node, 2, s.agent_seconds, steps_per_s=20.0, window_ms=2.0)
    config = asdict(s)
    del config["progress"]
    result: Report = {
        "benchmark": "directory",
        "config": {**section(as_json(config)), "key_bytes": KEY_BYTES},
        "machine": {**at_start, "loadavg_1m_at_end": machine()["loadavg_1m"]},
        "configs": as_json(configs),
        "concurrent": concurrent,
        "rows": as_json(rows),
        "agents": agent_run,
    }
    result["targets"] = [*_targets(result), *(agents.targets(agent_run) if agent_run else [])]
    return result


def _lookups(
    directory: DirectoryClient, pool: list[bytes], size: int, calls: int, rng: random.Random
) -> dict[str, float]:
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


def _floor(directory: DirectoryClient, pool: list[bytes], calls: int) -> dict[str, float]:
    """The per-call floor: sequential no-op ``ping`` calls to one shard, and
    1-key lookups through the client (p50/p99 ms), plus the shard's CPU per ping."""
    import ray

    shard = directory.shards[0]
    ping: list[float] = []
    ray.get(shard.ping.remote())
    cpu0 = _cpu([shard])
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(shard.ping.remote())
        ping.append(time.perf_counter() - t0)
    cpu_per_ping = (_cpu([shard]) - cpu0) / calls
    one: list[float] = []
    for key in pool[: calls + 2]:
        t0 = time.perf_counter()
        directory.prefix_lookup([key])
        one.append(time.perf_counter() - t0)
    one = one[2:]
    return {
        "ping_p50_ms": percentile(ping, 50) * 1e3,
        "ping_p99_ms": percentile(ping, 99) * 1e3,
        "ping_shard_cpu_us": cpu_per_ping * 1e6,
        "one_key_p50_ms": percentile(one, 50) * 1e3,
        "one_key_p99_ms": percentile(one, 99) * 1e3,
    }


def _client_class() -> Any:  # a Ray actor class (Ray's stubs type it as the Python class)
    import ray

    from raykv.core.wire import HolderInfo
    from raykv.holders.holder_actor import WatchableActor

    @ray.remote(num_cpus=0)
    class BenchEngine(WatchableActor):
        """A simulated engine: a holder of its own, stepping lookup + register + evict."""

        def __init__(self, shards: list[ActorHandle], index: int) -> None:
            from raykv.directory.client import DirectoryClient

            self.directory = DirectoryClient(shards)
            self.index = index

        def run(
            self, info: HolderInfo, pool: list[bytes], seconds: float, lookups: int, registers: int, seed: int
        ) -> ClientRun:
            from raykv.core.placement import prefix_of

            rng = random.Random(seed)
            mine: list[bytes] = []
            steps: list[float] = []
            keys_done = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                ask = rng.sample(pool, lookups // 2) + _keys(lookups - lookups // 2)
                fresh = _keys(registers)
                old, mine = mine[:registers], mine[registers:] + fresh
                t0 = time.perf_counter()
                refs = self.directory.register(info.holder_id, fresh)
                if old:
                    refs += self.directory.unregister(info.holder_id, old)
                hit = prefix_of(self.directory.lookup(ask), None)
                ray.get(refs)
                steps.append(time.perf_counter() - t0)
                keys_done += len(ask) + len(fresh) + len(old)
                assert hit.num_keys <= lookups
            return ClientRun(steps, keys_done)

    return BenchEngine


def _concurrent(services: RaykvServices, pool: list[bytes], s: Settings) -> Report:
    """``s.clients`` simulated engines stepping against one shard at once."""
    import ray

    from raykv.core.placement import PLASMA, HolderInfo

    directory = services.directory
    cls = _client_class()
    clients = [cls.remote(directory.shards, i) for i in range(s.clients)]
    infos = []
    for i, c in enumerate(clients):
        info = HolderInfo(f"bench:engine-{i}", "bench", PLASMA, f"bench-engine-{i}", services.namespace, f"node-{i}")
        ray.get(directory.add_holder(info, c))
        infos.append(info)
    rng = random.Random(1)
    samples = [rng.sample(pool, min(len(pool), 20_000)) for _ in clients]
    cpu0 = _cpu(directory.shards)
    t0 = time.perf_counter()
    outs: list[ClientRun] = ray.get(
        [
            c.run.remote(info, sample, s.seconds, s.step_lookups, s.step_registers, i)
            for i, (c, info, sample) in enumerate(zip(clients, infos, samples))
        ]
    )
    wall = time.perf_counter() - t0
    cpu = _cpu(directory.shards) - cpu0
    for c in clients:
        ray.kill(c)
    steps = [x for o in outs for x in o.steps]
    keys = sum(o.keys for o in outs)
    return {
        "clients": s.clients,
        "seconds": wall,
        "steps": len(steps),
        "keys": keys,
        "keys_per_s": keys / wall,
        "shard_cpu_s": cpu,
        "shard_cpu_us_per_key": cpu / keys * 1e6 if keys else None,
        "shard_busy": cpu / wall,
        "step_p50_ms": percentile(steps, 50) * 1e3 if steps else None,
        "step_p99_ms": percentile(steps, 99) * 1e3 if steps else None,
    }


def _pipelined(
    directory: DirectoryClient, pool: list[bytes], size: int, depth: int, rng: random.Random, quick: bool
) -> float:
    """Keys/s with ``depth`` batched lookups in flight (one caller)."""
    from raykv.core.placement import prefix_of

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


def _targets(result: Report) -> list[JsonValue]:
    """The targets, read off the report (``result`` as ``run`` wrote it)."""
    out: list[JsonValue] = []
    cfgs = {name: section(c) for name, c in section(result["configs"]).items()}
    sizes = [int(num(n)) for n in entries(section(result["config"])["call_sizes"])]
    big, small = str(max(sizes)), str(min(sizes))

    def call(c: Report, size: str, key: str) -> float | None:
        return number(section(section(c["calls"])[size])[key])

    one = [c for c in cfgs.values() if c["shards"] == 1]
    if one:
        worst = min(one, key=lambda c: num(call(c, big, "lookup_keys_per_s")))
        out.append(
            target(
                f"lookup keys/s of one shard, {int(big):,}-key calls (worst stored count)",
                call(worst, big, "lookup_keys_per_s"),
                3e6,
                detail=", ".join(
                    f"{c['stored_keys']:,} keys: {num(call(c, big, 'lookup_keys_per_s')):,.0f}" for c in one
                ),
            )
        )
        worst = min(one, key=lambda c: number(c["register_keys_per_s"]) or 0)
        out.append(
            target(
                "register keys/s of one shard, 100,000-key calls (worst stored count)",
                number(worst["register_keys_per_s"]),
                2e6,
                detail=", ".join(f"up to {c['stored_keys']:,}: {num(c['register_keys_per_s']):,.0f}" for c in one),
            )
        )
    p50 = {k: num(call(c, small, "lookup_p50_ms")) for k, c in cfgs.items()}
    p99 = {k: num(call(c, small, "lookup_p99_ms")) for k, c in cfgs.items()}
    if p99:
        worst_k = max(p50, key=lambda k: p50[k])
        out.append(
            target(
                f"p50 of a {int(small):,}-key call, ms (worst config)",
                p50[worst_k],
                1.5,
                higher_is_better=False,
                detail=f"{worst_k}; {_floor_detail(cfgs[worst_k], 'p50')}",
            )
        )
        worst_k = max(p99, key=lambda k: p99[k])
        out.append(
            target(
                f"p99 of a {int(small):,}-key call, ms (worst config)",
                p99[worst_k],
                5.0,
                higher_is_better=False,
                detail=f"{worst_k}; {_floor_detail(cfgs[worst_k], 'p99')}",
            )
        )
    bpk = {k: num(c["bytes_per_key"]) for k, c in cfgs.items()}
    if bpk:
        worst_k = max(bpk, key=lambda k: bpk[k])
        out.append(
            target("directory bytes per key (worst config)", bpk[worst_k], 48.0, higher_is_better=False, detail=worst_k)
        )
    for count in entries(section(result["config"])["keys"]):
        row = sorted(
            ((int(num(c["shards"])), c) for c in cfgs.values() if c["stored_keys"] == count), key=lambda p: p[0]
        )
        if len(row) < 2:
            continue
        for metric, label in (("seq", "sequential"), ("pipe", "pipelined")):
            vals = [
                (n, call(c, big, "lookup_keys_per_s") if metric == "seq" else number(c["lookup_keys_per_s_pipelined"]))
                for n, c in row
            ]
            growth = ratio(vals[-1][1], vals[0][1])
            out.append(
                target(
                    f"keys/s {vals[-1][0]} shards / 1 shard, {label} {int(big):,}-key calls, {num(count):,.0f} keys",
                    growth,
                    1.0,
                    detail=", ".join(f"{n}: {num(v):,.0f}" for n, v in vals),
                )
            )
    return out


def _floor_detail(config: Report, q: str) -> str:
    floor = section(config.get("floor"))
    if not floor:
        return "floor not measured"
    return f"no-op call {num(floor[f'ping_{q}_ms']):.2f} ms, 1-key lookup {num(floor[f'one_key_{q}_ms']):.2f} ms"


def format_result(result: Report) -> str:
    cfg = section(result["config"])
    configs = [section(c) for c in section(result["configs"]).values()]
    machine_info = section(result["machine"])
    big = str(max(int(num(n)) for n in entries(cfg["call_sizes"])))
    fewest = min(num(n) for n in entries(cfg["keys"]))
    rows = []
    for c in configs:
        for size, mv in section(c["calls"]).items():
            m = section(mv)
            rows.append(
                [
                    c["shards"],
                    f"{num(c['stored_keys']):,.0f}",
                    f"{int(size):,}",
                    m["lookup_keys_per_s"],
                    m["lookup_p50_ms"],
                    m["lookup_p99_ms"],
                    m.get("shard_cpu_us_per_key"),
                    c["bytes_per_key"],
                    c["lookup_keys_per_s_pipelined"] if size == big else None,
                ]
            )
    reg = [
        [c["shards"], f"{num(c['stored_keys']):,.0f}", c["register_keys_per_s"], c["register_cpu_us_per_key"]]
        for c in configs
    ]
    parts = [
        f"directory: {cfg['key_bytes']}-byte keys, one caller; pipelined = {cfg['pipeline']} calls in flight; "
        f"load average {machine_info.get('loadavg_1m')} at start,"
        f" {machine_info.get('loadavg_1m_at_end')} at end",
        table(
            (
                "shards",
                "stored keys",
                "keys/call",
                "keys/s",
                "p50 ms",
                "p99 ms",
                "shard CPU us/key",
                "bytes/key",
                "keys/s pipelined",
            ),
            rows,
        ),
        "\nper-call floor: sequential calls, one caller (no-op = the shard's ping; CPU = the shard's, per ping)",
        table(
            ("shards", "no-op p50 ms", "no-op p99 ms", "shard CPU us/no-op", "1-key p50 ms", "1-key p99 ms"),
            [
                [
                    c["shards"],
                    f["ping_p50_ms"],
                    f["ping_p99_ms"],
                    f["ping_shard_cpu_us"],
                    f["one_key_p50_ms"],
                    f["one_key_p99_ms"],
                ]
                for c in configs
                if (f := section(c.get("floor"))) and c["stored_keys"] == fewest
            ],
        ),
        "\nregistration: sequential 100,000-key calls, one caller",
        table(("shards", "stored keys (up to)", "keys/s", "shard CPU us/key"), reg),
    ]
    conc = section(result.get("concurrent"))
    if conc:
        parts += [
            f"\n{conc['clients']} simulated engines on one shard for {num(conc['seconds']):.1f} s: each step looks up "
            f"{cfg['step_lookups']} keys (half stored), registers {cfg['step_registers']}"
            f" and evicts {cfg['step_registers']}",
            table(
                ("clients", "steps", "keys/s", "shard CPU us/key", "shard busy", "step p50 ms", "step p99 ms"),
                [
                    [
                        conc["clients"],
                        conc["steps"],
                        conc["keys_per_s"],
                        conc["shard_cpu_us_per_key"],
                        conc["shard_busy"],
                        conc["step_p50_ms"],
                        conc["step_p99_ms"],
                    ]
                ],
            ),
        ]
    agent_run = section(result.get("agents"))
    if agent_run:
        parts.append(agents.format_section(agent_run))
    parts.append("\n" + targets_table(result["targets"]))
    return "\n".join(parts)
