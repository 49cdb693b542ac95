"""The node-agent part of ``raykv bench directory``: N nodes x E engines, with and without agents.

On an embedded local Ray it simulates ``nodes`` nodes (node ids made up: every
actor runs on this host) with ``engines`` engine processes each (actors), and
runs the same trace twice: once with every engine calling the shards itself
(raykv before node agents), once through one ``DirectoryAgent`` per node with
its view in ``/dev/shm``. Each node also has one holder (its object store,
``WatchableActor``): the engines register and evict the blocks they compute
as that holder, the way an object-store actor does for its node's engines.

The trace (SCALING.md's per-step mix, scaled to this host): every engine
steps ``steps_per_s`` times a second; each step looks up one request's prefix
of ``prefix_keys`` keys at once (``LookupCache.resolve``, waited for). A
quarter of the requests bring a prefix nobody has seen (their keys are then
registered, and as many old ones of the engine evicted); the others reuse one
of ``prefixes`` shared prefixes, popular ones more often (Zipf, s = 1).

Reported per configuration: calls per shard per second (all methods), the
shards' CPU, each lookup's latency (p50/p99) and how many went without any
Ray call, and with agents the replica lag (change at a shard -> node view)
and the time to read a 32-key prefix from the view.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, NamedTuple

from raykv.bench.common import num, percentile, random_keys, section, table, target
from raykv.core import signals
from raykv.core.wire import JsonValue, Report

KEY_BYTES = 44
TAG = bytes.fromhex("0a6e7715ba5e1e55")


class EngineRun(NamedTuple):
    """What one simulated engine measured: each lookup's seconds, and those that made no call."""

    latencies: list[float]
    no_call: int


def _keys(n: int) -> list[bytes]:
    return random_keys(n, TAG, KEY_BYTES)


def _engine_class() -> Any:  # a Ray actor class (Ray's stubs type it as the Python class)
    import ray

    @ray.remote(num_cpus=0)
    class BenchNodeEngine:
        """One simulated engine: a ``LookupCache`` as raykv's tiers use it."""

        def __init__(self, namespace: str, node: str, shards: list[Any], agent: Any | None) -> None:
            from raykv.directory.client import AgentClient, DirectoryClient, LookupCache
            from raykv.directory.shm_view import ViewReader, view_path

            self.direct = DirectoryClient(shards)
            self.writes: AgentClient | DirectoryClient = self.direct
            view = None
            if agent is not None:
                self.writes = AgentClient(agent, len(shards))
                view = ViewReader(view_path(namespace, node))
            self.cache = LookupCache(self.writes, view=view)

        def ready(self) -> bool:
            return True

        def run(
            self,
            holder_id: str,
            prefixes: list[list[bytes]],
            seconds: float,
            steps_per_s: float,
            seed: int,
            start_at: float,
        ) -> EngineRun:
            """Step from ``start_at`` (``time.time()``, the same for every engine) for ``seconds``."""
            time.sleep(max(0.0, start_at - time.time()))
            rng = random.Random(seed)
            weights = [1.0 / (i + 1) for i in range(len(prefixes))]
            size = len(prefixes[0])
            mine: list[bytes] = []
            lat: list[float] = []
            no_call = 0
            period = 1.0 / steps_per_s
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t_step = time.monotonic()
                new = rng.random() < 0.25
                keys = _keys(size) if new else rng.choices(prefixes, weights)[0]
                sent = self.cache.lookups_sent
                t0 = time.perf_counter()
                self.cache.resolve(keys, 1.0)
                lat.append(time.perf_counter() - t0)
                no_call += self.cache.lookups_sent == sent
                if new:  # computed: the node's holder now has it, and evicts as much
                    refs = self.writes.register(holder_id, keys)
                    mine += keys
                    if len(mine) > 16 * size:
                        old, mine = mine[:size], mine[size:]
                        refs += self.writes.unregister(holder_id, old)
                    ray.get(refs)
                time.sleep(max(0.0, period - (time.monotonic() - t_step)))
            return EngineRun(lat, no_call)

        def view_read(self, keys: list[bytes], rounds: int) -> list[float]:
            """Seconds per read of ``keys`` from the node's view (None: no view)."""
            view = self.cache.view
            out = []
            if view is not None:
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    view.lookup(keys)
                    out.append(time.perf_counter() - t0)
            return out

    return BenchNodeEngine


def _shard_figures(shards: list[Any]) -> tuple[dict[str, int], float]:
    """Calls the shards took so far, by method, and their CPU seconds."""
    import ray

    def cpu(_self: object) -> float:
        return time.process_time()

    calls: dict[str, int] = {}
    for st in ray.get([s.stats.remote() for s in shards]):
        for method, n in st.calls.items():
            calls[method] = calls.get(method, 0) + n
    return calls, sum(ray.get([s.__ray_call__.remote(cpu) for s in shards]))


def _one_config(
    mode: str, nodes: int, engines: int, shards_n: int, seconds: float, steps_per_s: float, window_ms: float
) -> Report:
    """One run of the trace; ``mode``: "none" (no agents), "all" (agents, views of
    every key: the default) or "asked" (agents, views of local and asked keys)."""
    with_agents = mode != "none"
    import ray

    import raykv
    from raykv.core.placement import PLASMA, HolderInfo
    from raykv.directory.agent import start_agent
    from raykv.holders.holder_actor import WatchableActor

    ns = f"raykv-bench-agents-{mode}"
    services = raykv.start(
        {
            "namespace": ns,
            "directory_shards": shards_n,
            "directory_agent": with_agents,
            "agent_window_ms": window_ms,
            "agent_view_all_keys": mode == "all",
        }
    )
    holder_cls: Any = ray.remote(num_cpus=0)(type("BenchNodeHolder", (WatchableActor,), {}))
    shards = services.directory.shards
    cls = _engine_class()
    agents: list[Any] = []
    holders: list[Any] = []
    clients: list[Any] = []
    jobs: list[tuple[Any, str, int]] = []
    prefixes = [_keys(32) for _ in range(64)]
    try:
        for n in range(nodes):
            node = f"bench-node-{n}-{os.urandom(4).hex()}"
            holder = holder_cls.remote()
            info = HolderInfo(f"bench:os:{node}", "object_store", PLASMA, f"bench-os-{n}", ns, node)
            ray.get(services.directory.add_holder(info, holder))
            holders.append(holder)
            agent = None
            if with_agents:
                agent = start_agent(ns, node, shards, window_ms, 1_000_000, pinned=False, all_keys=mode == "all")
                for _ in range(50):  # follow the feeds (and, all keys: read every holder) before the trace
                    if ray.get(agent.ready.remote()) or mode != "all":
                        break
                    time.sleep(0.02)
                agents.append(agent)
            for e in range(engines):
                c = cls.remote(ns, node, shards, agent)
                clients.append(c)
                jobs.append((c, info.holder_id, n * engines + e))
        ray.get([c.ready.remote() for c in clients])  # every engine started: the rates are the trace's own
        calls0, cpu0 = _shard_figures(shards)
        start_at = time.time() + 0.5
        t0 = time.perf_counter()
        outs: list[EngineRun] = ray.get(
            [c.run.remote(h, prefixes, seconds, steps_per_s, seed, start_at) for c, h, seed in jobs]
        )
        calls1, cpu1 = _shard_figures(shards)
        wall = time.perf_counter() - t0 - 0.5
        lat = [x for o in outs for x in o.latencies]
        lookups = len(lat)
        no_call = sum(o.no_call for o in outs)
        per_method = {m: (n - calls0.get(m, 0)) / wall / shards_n for m, n in calls1.items() if n > calls0.get(m, 0)}
        result: Report = {
            "agents": with_agents,
            "mode": mode,
            "seconds": wall,
            "lookups": lookups,
            "lookups_without_a_call": no_call,
            "calls_per_shard_per_s": sum(per_method.values()),
            "calls_per_shard_per_s_by_method": {m: round(v, 1) for m, v in sorted(per_method.items())},
            "shard_cpu_busy": (cpu1 - cpu0) / wall,
            "lookup_p50_ms": percentile(lat, 50) * 1e3 if lat else None,
            "lookup_p99_ms": percentile(lat, 99) * 1e3 if lat else None,
        }
        if with_agents:
            stats = ray.get([a.stats.remote() for a in agents])
            p99s = [s.lag_p99_s for s in stats if s.lag_p99_s is not None]
            p50s = [s.lag_p50_s for s in stats if s.lag_p50_s is not None]
            result["lag_p50_ms"] = max(p50s) * 1e3 if p50s else None
            result["lag_p99_ms"] = max(p99s) * 1e3 if p99s else None
            result["view_keys"] = [s.view_keys for s in stats]
            result["view_bytes"] = [s.view_bytes for s in stats]
            reads = ray.get(clients[0].view_read.remote(prefixes[0], 2000))
            result["view_read_32_p50_us"] = percentile(reads, 50) * 1e6 if reads else None
            result["view_read_32_p99_us"] = percentile(reads, 99) * 1e6 if reads else None
        return result
    finally:
        for actor in [*clients, *agents, *holders]:
            ray.kill(actor)
        services.shutdown()


def run_section(nodes: int, engines: int, shards: int, seconds: float, steps_per_s: float, window_ms: float) -> Report:
    """Both configurations on a fresh embedded local Ray; the ``agents`` section of the report."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    signals.after_ray_init()
    try:
        without = _one_config("none", nodes, engines, shards, seconds, steps_per_s, window_ms)
        with_ = _one_config("all", nodes, engines, shards, seconds, steps_per_s, window_ms)
        asked = _one_config("asked", nodes, engines, shards, seconds, steps_per_s, window_ms)
    finally:
        ray.shutdown()
    before, after = num(without["calls_per_shard_per_s"]), num(with_["calls_per_shard_per_s"])
    after_asked = num(asked["calls_per_shard_per_s"])
    return {
        "nodes": nodes,
        "engines_per_node": engines,
        "shards": shards,
        "steps_per_s": steps_per_s,
        "window_ms": window_ms,
        "without_agents": without,
        "with_agents": with_,
        "with_agents_asked_keys": asked,
        "calls_per_shard_fewer_x": before / after if after else None,
        "calls_per_shard_fewer_x_asked_keys": before / after_asked if after_asked else None,
    }


def targets(agents: Report) -> list[JsonValue]:
    """The issue's targets for the agents, read off the section."""
    w = section(agents["with_agents"])

    def value(key: str) -> float | None:
        v = w.get(key)
        return None if v is None else num(v)

    fewer = agents.get("calls_per_shard_fewer_x")
    return [
        target("32-key prefix from the node's view, p50 us", value("view_read_32_p50_us"), 50.0, False),
        target("32-key prefix from the node's view, p99 us", value("view_read_32_p99_us"), 500.0, False),
        target(
            f"calls per shard per second, x fewer with agents ({agents['engines_per_node']} engines per node)",
            None if fewer is None else num(fewer),
            8.0,
        ),
        target("replica lag p99 ms (shard change -> node view)", value("lag_p99_ms"), 100.0, False),
    ]


def format_section(agents: Report) -> str:
    rows = []
    names = {
        "without_agents": "no agents",
        "with_agents": "agents (views of every key)",
        "with_agents_asked_keys": "agents, asked keys only",
    }
    for key, name in names.items():
        c = section(agents.get(key))
        if not c:
            continue
        rows.append(
            [
                name,
                c["lookups"],
                c["lookups_without_a_call"],
                c["calls_per_shard_per_s"],
                c["shard_cpu_busy"],
                c["lookup_p50_ms"],
                c["lookup_p99_ms"],
                c.get("lag_p50_ms"),
                c.get("lag_p99_ms"),
                c.get("view_read_32_p50_us"),
            ]
        )
    return "\n".join(
        [
            f"\n{agents['nodes']} simulated nodes x {agents['engines_per_node']} engines, {agents['shards']} shards, "
            f"{agents['steps_per_s']} steps/s per engine, agent window {agents['window_ms']} ms",
            table(
                (
                    "config",
                    "lookups",
                    "no call",
                    "calls/shard/s",
                    "shard busy",
                    "lookup p50 ms",
                    "lookup p99 ms",
                    "lag p50 ms",
                    "lag p99 ms",
                    "view 32-key p50 us",
                ),
                rows,
            ),
        ]
    )
