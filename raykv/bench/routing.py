"""``raykv bench routing``: one Ray Serve LLM app, three request routers, one trace.

An embedded cluster (``ray.cluster_utils.Cluster``, one node per replica) runs
a Serve LLM app of N vLLM replicas (the local bench model on CPU, whose
prefill costs what a real model's does per byte of KV; ``--tiny`` for the tiny
model, or ``--model``) with raykv's tiers (each node's object store, a shared
fs root) behind a CPU primary sized as a deployment sizes it
(``raykv.demo.replicas.deployment_primary_chunks``, or ``--primary-chunks``),
once per router: Serve's default (power of two choices), Ray's
``PrefixCacheAffinityRouter`` and raykv's router. Each run starts from empty
caches (its own raykv namespace and root) and gets the same trace: multi-turn
sessions of several tenants (a system prompt per tenant, a history per
session), ``--concurrency`` sessions at a time, the last quarter of the
sessions arriving once half of the requests are done.

Per request the bench asks the directory, before sending, how many leading
blocks each engine holds (every run records engine caches, whatever its
router), and after the answer which replica computed it; so the prompt's
cached tokens split into the serving engine's own cache and raykv's tiers
(with vLLM's per-replica CPU primary), the rest recomputed. TTFT is the
latency of a one-token completion.

The trace's oracle is one unbounded cluster-wide cache
(``raykv.demo.workload.oracle_hit_tokens``): every router's hits by source are
also reported as a share of it. Blocks that vLLM's cascade never offered to
raykv because a replica's CPU primary was full are counted
(``raykv_cascade_dropped_blocks``) and reported per router.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypedDict, final

from typing_extensions import NotRequired  # typing has it from Python 3.11

from raykv.bench.common import (
    Failed,
    Tokenizer,
    as_json,
    at_least,
    bad_option,
    decode,
    fill_defaults,
    machine,
    names_option,
    number,
    percentile,
    read_settled,
    section,
    table,
    target,
    targets_table,
)
from raykv.bench.serve_app import ENGINE_BLOCKS, bench_app, start_cluster
from raykv.core.wire import HolderInfo, JsonValue, Report
from raykv.demo.models import resolve_model
from raykv.demo.replicas import PRIMARY_PER_ENGINE_BLOCK

if TYPE_CHECKING:
    from raykv.demo.replicas import Progress
    from raykv.serve.routing import EngineLayout
    from raykv.services.cluster import RaykvServices

HELP = "Ray Serve LLM replicas under Serve's default, prefix-affinity and raykv routers: hits by source, TTFT, load"

ROUTERS = ("default", "prefix_affinity", "raykv")
BLOCK = 128
URL = "http://127.0.0.1:8000/v1/completions"
MODEL_ID = "bench"
#: A router that cannot serve a request in this time is reported as failed (the others still run).
REQUEST_TIMEOUT_S = 60


def full_block_tokens(tokens: int) -> int:
    """``tokens`` rounded down to full blocks of ``BLOCK``: what an engine or raykv can find cached."""
    return tokens // BLOCK * BLOCK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, help="vLLM replicas, one per simulated node (default 3; quick 2)")
    p.add_argument("--sessions", type=int, help="conversations (default 12; quick 4)")
    p.add_argument("--turns", type=int, help="turns per conversation (default 3; quick 2)")
    p.add_argument("--tenants", type=int, default=3, help="tenants, each with its own system prompt (default 3)")
    p.add_argument("--concurrency", type=int, help="sessions in flight at once (default 4; quick 2)")
    p.add_argument(
        "--model",
        help="'bench' (default: the local bench model, prefill priced like a real model's), "
        "'tiny' (the tiny local model: fast runs; the default with --quick), or a model directory",
    )
    p.add_argument("--tiny", action="store_true", help="the tiny local model (same as --model tiny)")
    p.add_argument(
        "--primary-chunks",
        type=int,
        help="chunks (blocks) of each replica's vLLM CPU primary (default: "
        "raykv.demo.replicas.deployment_primary_chunks of the engine's cache: "
        f"{PRIMARY_PER_ENGINE_BLOCK} x {ENGINE_BLOCKS} blocks)",
    )
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated subset of {', '.join(ROUTERS)}")
    p.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="NAME=NUMBER",
        help="an option of the raykv router (its router_kwargs: load_weight, max_load_share, min_queue_gap, "
        "lookup_timeout_s); repeatable",
    )


#: The raykv router's numeric options ``--router-option`` may set.
ROUTER_OPTIONS = ("load_weight", "max_load_share", "min_queue_gap", "lookup_timeout_s")


def router_options(items: list[str]) -> dict[str, float]:
    """``--router-option NAME=NUMBER`` items as the raykv router's kwargs (checked)."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in ROUTER_OPTIONS:
            raise bad_option(
                f"--router-option: {item!r} is not NAME=NUMBER with NAME one of {', '.join(ROUTER_OPTIONS)}"
            )
        try:
            out[name] = float(value)
        except ValueError:
            raise bad_option(f"--router-option {name}: {value!r} is not a number") from None
    if "min_queue_gap" in out:
        out["min_queue_gap"] = int(out["min_queue_gap"])
    return out


@dataclass
class Session:
    index: int
    tenant: int
    turns: list[str]  # each turn's whole prompt (text: Ray's prefix-affinity router reads text only)
    tokens: list[list[int]]  # the same, as the model's tokenizer splits it (what engines hash)
    late: bool


def build_sessions(sessions: int, turns: int, tenants: int, tokenizer: Tokenizer, seed: int = 7) -> list[Session]:
    """Sessions of ``tenants`` tenants: a ~3-block system prompt per tenant, then
    per turn 1-2 blocks of text (a user message and an answer) appended to the history."""
    from raykv.demo.tiny_model import make_prompt_tokens

    def text(n_tokens: int, s: int) -> str:
        return decode(tokenizer, make_prompt_tokens(n_tokens, s))

    rng = random.Random(seed)
    system = [text(3 * BLOCK, 50_000 + t) for t in range(tenants)]
    out = []
    for s in range(sessions):
        # at least a block of the session's own, so its last full block names the session
        prompt = system[s % tenants] + "\n" + text(BLOCK + rng.randrange(BLOCK), 60_000 + s)
        history = [prompt]
        for t in range(1, turns):
            prompt = prompt + "\n" + text(BLOCK + rng.randrange(BLOCK), 70_000 + 100 * s + t)
            history.append(prompt)
        late = s >= sessions - max(1, sessions // 4)
        out.append(Session(s, s % tenants, history, [list(tokenizer.encode(p)) for p in history], late))
    return out


class RequestRecord(TypedDict):
    """One answered request of the trace (``_drive``)."""

    session: int
    turn: int
    replica: str | None  # the replica that computed it (None: not attributed)
    prompt_tokens: int
    cached_tokens: int
    engine_hit_tokens: int  # of the cached tokens, those from the serving engine's own cache
    #: the same as the directory listed the engine's blocks before sending (``credit_same_engine``)
    engine_hit_tokens_listed: NotRequired[int]
    ttft_ms: float
    sent: NotRequired[float]  # seconds since the trace started, when it was sent
    at: float  # seconds since the trace started, when it answered


@final  # so that ``"error" in r`` tells a failure (``Failed``) from a summary
class RouterSummary(TypedDict):
    """One router's figures over the trace (``_summary``, then ``_run_router``'s additions)."""

    engine_hit_tokens: int
    raykv_hit_tokens: int
    recomputed_tokens: int
    prompt_tokens: int
    oracle_share: dict[str, float]
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    max_load_share: float
    requests_per_replica: list[int]
    unattributed_requests: int
    #: each request in the order answered (which replica, what it found where): to see why a
    #: router missed a hit the oracle counts
    requests: list[RequestRecord]
    engine_nodes: NotRequired[int]
    router_ms_per_request: NotRequired[float | None]  # the raykv router's only
    router_stage_ms: NotRequired[dict[str, float]]
    #: decision time quantiles, from the router's histogram buckets (interpolated)
    router_decision_p50_ms: NotRequired[float | None]
    router_decision_p99_ms: NotRequired[float | None]
    router_cpu_ms_per_request: NotRequired[float | None]  # the router thread's CPU per decision
    cascade_dropped_blocks: NotRequired[int]


class RoutingResult(TypedDict):
    """The JSON result of ``raykv bench routing``."""

    benchmark: str
    machine: Report
    replicas: int
    sessions: int
    turns: int
    tenants: int
    concurrency: int
    requests: int
    model: str
    engine_blocks: int
    primary_chunks: int
    cpu_bytes: int
    oracle_hit_tokens: int
    router_options: dict[str, float]  # --router-option: the raykv router's kwargs
    routers: dict[str, RouterSummary | Failed]
    targets: list[Report]


class Usage(NamedTuple):
    """The token counts of a completion's ``usage``."""

    prompt_tokens: int
    cached_tokens: int


def usage_of(usage: JsonValue) -> Usage:
    """An OpenAI ``usage`` object's prompt tokens and cached prompt tokens (0 when absent)."""
    u = section(usage)
    cached = number(section(u.get("prompt_tokens_details")).get("cached_tokens"))
    return Usage(int(number(u.get("prompt_tokens")) or 0), int(cached or 0))


def oracle_hit_tokens(sessions: list[Session]) -> int:
    """Prompt tokens the trace's oracle hits (one unbounded cluster-wide cache), over the
    prompts as the model tokenizes them, in the order the bench sends them: sessions in
    queue order, each session's turns in order. (Sessions share only their tenant's
    system prompt, so how the concurrent sessions interleave does not change it.)"""
    from raykv.demo import workload

    sent = [(s.index, t, tokens) for s in sorted(sessions, key=lambda s: s.late) for t, tokens in enumerate(s.tokens)]
    trace = [workload.TraceRequest(i, session, turn, 0, tokens) for i, (session, turn, tokens) in enumerate(sent)]
    return workload.oracle_hit_tokens(trace, BLOCK)


def primary_chunks(args: argparse.Namespace) -> int:
    """Chunks of each replica's CPU primary: ``--primary-chunks``, else as a deployment sizes it."""
    from raykv.demo.replicas import deployment_primary_chunks

    chunks = deployment_primary_chunks(ENGINE_BLOCKS) if args.primary_chunks is None else args.primary_chunks
    if chunks < 1:
        raise bad_option(f"--primary-chunks: at least 1, got {chunks}")
    return chunks


def run(args: argparse.Namespace) -> RoutingResult:
    """Run the trace under each router; returns the JSON result."""
    import ray
    from tqdm import tqdm

    from raykv.demo.replicas import chunk_bytes
    from raykv.integrations.vllm import require_vllm

    fill_defaults(
        args,
        {"replicas": 3, "sessions": 12, "turns": 3, "concurrency": 4},
        {"replicas": 2, "sessions": 4, "turns": 2, "concurrency": 2},
    )
    if args.replicas < 2:
        raise bad_option("--replicas: at least 2 (routing picks between replicas)")
    at_least(1, sessions=args.sessions, turns=args.turns, tenants=args.tenants, concurrency=args.concurrency)
    require_vllm()
    chunks = primary_chunks(args)
    options = router_options(args.router_option)
    routers = names_option("--routers", args.routers, ROUTERS, allow_empty=True)
    from transformers import AutoTokenizer

    model, model_name = resolve_model(args)
    cpu_bytes = chunks * chunk_bytes(model)
    sessions = build_sessions(args.sessions, args.turns, args.tenants, AutoTokenizer.from_pretrained(model))
    requests_total = sum(len(s.turns) for s in sessions)
    oracle = oracle_hit_tokens(sessions)
    info = machine()
    cluster = start_cluster(args.replicas, model)
    progress = tqdm(total=len(routers) * requests_total, file=sys.stderr, disable=args.no_progress, unit="req")
    per_router: dict[str, RouterSummary | Failed] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="raykv-bench-routing-") as root:
            for name in routers:
                try:
                    per_router[name] = _run_router(
                        name, model, f"{root}/{name}", args, sessions, progress, cpu_bytes, oracle
                    )
                except Exception as e:  # noqa: BLE001 - one router failing must not lose the others' figures
                    per_router[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        progress.close()
        ray.shutdown()  # and the cluster with Serve in it (serve.shutdown() would print on stdout)
        cluster.shutdown()
    return {
        "benchmark": "routing",
        "machine": info,
        "replicas": args.replicas,
        "sessions": args.sessions,
        "turns": args.turns,
        "tenants": args.tenants,
        "concurrency": args.concurrency,
        "requests": requests_total,
        "model": model_name,
        "engine_blocks": ENGINE_BLOCKS,
        "primary_chunks": chunks,
        "cpu_bytes": cpu_bytes,
        "oracle_hit_tokens": oracle,
        "router_options": options,
        "routers": per_router,
        "targets": _targets(per_router),
    }


def _run_router(
    name: str,
    model: str,
    root: str,
    args: argparse.Namespace,
    sessions: list[Session],
    progress: Progress,
    cpu_bytes: int,
    oracle: int,
) -> RouterSummary:
    from ray import serve

    import raykv

    namespace = f"raykv-bench-routing-{name.replace('_', '-')}"
    services = raykv.start({"namespace": namespace, "directory_shards": 2})
    app = bench_app(
        model,
        model_id=MODEL_ID,
        replicas=args.replicas,
        router=name,
        raykv={"namespace": namespace, "tiers": [{"type": "object_store"}, {"type": "fs", "root": root}]},
        cpu_bytes=cpu_bytes,
        engine_cache=True,  # every run records engine caches: that is how hits are attributed
        router_kwargs=router_options(args.router_option) if name == "raykv" else None,
    )
    try:
        serve.run(app, name="raykv-bench-routing", route_prefix="/", blocking=False)
        watch = EngineWatch(services, model)
        engines = watch.wait_engines(args.replicas)
        _warm_up(args.replicas)
        # The router's cost is measured over the trace: its one-off set-up (vLLM's
        # hashing, the tokenizer) falls on the warm-up requests, counted before.
        before = _router_totals() if name == "raykv" else None
        results = _drive(sessions, args.concurrency, watch, progress)
        credit_same_engine(results, sessions)
        summary = _summary(results, oracle, args.replicas)
        summary["engine_nodes"] = len({e.node_id for e in engines})  # one replica per simulated node
        if before is not None:
            after = _router_totals()
            summary["router_ms_per_request"], summary["router_stage_ms"] = _router_cost_ms(before, after)
            summary["router_decision_p50_ms"] = decision_quantile_ms(before, after, 0.5)
            summary["router_decision_p99_ms"] = decision_quantile_ms(before, after, 0.99)
            summary["router_cpu_ms_per_request"] = decision_cpu_ms(before, after)
        summary["cascade_dropped_blocks"] = cascade_drops(namespace)
    finally:
        # delete the app, not Serve: killing Serve's controller prints Ray's warnings on
        # stdout, where --json writes its object
        serve.delete("raykv-bench-routing")
        services.shutdown()
    return summary


#: Seconds between two reads of the router's metrics that must agree before they
#: count as complete (Ray exports a process's metrics every few seconds).
METRICS_SETTLE_S = 6.0


class RouterTotals(NamedTuple):
    """The raykv router's metrics summed over the cluster at one moment."""

    seconds: float
    decisions: float
    stages: dict[str, float]  # seconds by stage
    buckets: dict[float, float]  # decisions taking at most ``le`` seconds (the histogram's buckets)
    cpu_seconds: float = 0.0  # the router thread's CPU time in decisions


def _router_totals(timeout_s: float = 40.0) -> RouterTotals:
    """The raykv router's metrics summed over the cluster: decision seconds, decisions,
    seconds by stage, decision buckets. Read until two reads ``METRICS_SETTLE_S`` apart agree."""
    from raykv.metrics.scrape import scrape_cluster

    def read() -> RouterTotals:
        series = scrape_cluster()
        total = sum(v for n, _, v in series if n == "ray_raykv_router_decision_seconds_sum")
        count = sum(v for n, _, v in series if n == "ray_raykv_router_decision_seconds_count")
        cpu = sum(v for n, _, v in series if n == "ray_raykv_router_decision_cpu_seconds_total")
        stages: dict[str, float] = {}
        buckets: dict[float, float] = {}
        for n, labels, v in series:
            if n == "ray_raykv_router_stage_seconds_total":
                stage = labels.get("stage", "?")
                stages[stage] = stages.get(stage, 0.0) + v
            elif n == "ray_raykv_router_decision_seconds_bucket" and "le" in labels:
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        return RouterTotals(total, count, stages, buckets, cpu)

    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(METRICS_SETTLE_S)
        now = read()
        if now[1] == last[1] and now[1] > 0:
            return now
        last = now
    return last


def cascade_drops(namespace: str, min_wait_s: float = 2 * METRICS_SETTLE_S, timeout_s: float = 40.0) -> int:
    """Blocks the replicas of raykv namespace ``namespace`` computed but could not put in their
    full CPU primary, so vLLM's cascade offered them to no raykv tier (the Ray metric
    ``raykv_cascade_dropped_blocks``). Read until two reads ``METRICS_SETTLE_S`` apart agree,
    ``min_wait_s`` after the first at least (Ray exports a process's metrics every few
    seconds, and a count may be 0)."""
    from raykv.metrics.scrape import scrape_cluster

    def read() -> float:
        return sum(
            v
            for n, labels, v in scrape_cluster()
            if n == "ray_raykv_cascade_dropped_blocks_total" and labels.get("namespace") == namespace
        )

    return int(read_settled(read, METRICS_SETTLE_S, timeout_s, min_wait_s))


def _router_cost_ms(before: RouterTotals, after: RouterTotals | None = None) -> tuple[float | None, dict[str, float]]:
    """Mean time the raykv router spent per decision since ``before``, in all and by stage."""
    total, count, stages, _, _ = after if after is not None else _router_totals()
    decisions = count - before.decisions
    if decisions <= 0:
        return None, {}
    by_stage = {stage: (s - before.stages.get(stage, 0.0)) / decisions * 1000 for stage, s in stages.items()}
    return (total - before.seconds) / decisions * 1000, by_stage


def decision_cpu_ms(before: RouterTotals, after: RouterTotals) -> float | None:
    """Mean CPU time of the router's thread per decision between two reads, in ms."""
    decisions = after.decisions - before.decisions
    return (after.cpu_seconds - before.cpu_seconds) / decisions * 1000 if decisions > 0 else None


def decision_quantile_ms(before: RouterTotals, after: RouterTotals, q: float) -> float | None:
    """The ``q`` quantile of the decisions between two reads, in ms, from the histogram's
    buckets: linear within the bucket it falls in, as Prometheus' ``histogram_quantile``."""
    edges = sorted(le for le in after.buckets if le != float("inf"))
    cumulative = [after.buckets[le] - before.buckets.get(le, 0.0) for le in edges]
    n = after.decisions - before.decisions
    if n <= 0 or not edges:
        return None
    rank, lower, below = q * n, 0.0, 0.0
    for le, count in zip(edges, cumulative):
        if count >= rank:
            inside = count - below
            return (lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)) * 1000
        lower, below = le, count
    return edges[-1] * 1000  # past the last finite edge: at least this


class EngineWatch:
    """Reads the engines' caches from the directory (leading blocks per replica, who computed a block)."""

    def __init__(self, services: RaykvServices, model: str) -> None:
        self.services = services
        self.model = model
        self._layout: EngineLayout | None = None

    def wait_engines(self, n: int, timeout_s: float = 600) -> list[HolderInfo]:
        """Until the app answers and ``n`` engines announced their caches; returns their holders."""
        import requests

        from raykv.core.placement import ENGINE

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ok = requests.get("http://127.0.0.1:8000/v1/models", timeout=5).ok
            except requests.RequestException:
                ok = False
            engines = [h for h in self.services.holders() if h.medium == ENGINE]
            if ok and len(engines) >= n:
                return engines
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Serve app did not come up with {n} engines in {timeout_s:.0f} s")
            time.sleep(1)

    def _keys(self, tokens: list[int]) -> list[bytes]:
        from raykv.integrations.vllm.hashing import block_hashes
        from raykv.serve.routing import EngineLayout, request_keys

        if self._layout is None:
            found = [(t, i) for t, i in self.services.identities().items() if i.model == self.model]
            self._layout = EngineLayout.from_identity(*found[0])
        engine, _ = request_keys(block_hashes(tokens, self._layout.tokens_per_hash), self._layout)
        return engine

    def owners(self, tokens: list[int]) -> list[set[str]]:
        """Per full block of ``tokens``: the replicas (owner actor ids) whose engine holds it."""
        from raykv.core.placement import ENGINE

        keys = self._keys(tokens)
        found = self.services.directory.lookup(keys) if keys else []
        return [{h.owner or h.holder_id for h in hs if h.medium == ENGINE} for hs in found]

    def leading(self, tokens: list[int]) -> Counter[str]:
        """Leading blocks of ``tokens`` each replica's engine holds."""
        out: Counter[str] = Counter()
        alive: set[str] | None = None
        for owners in self.owners(tokens):
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for o in alive:
                out[o] += 1
        return out

    def computed_by(self, tokens: list[int], timeout_s: float = 5.0) -> str | None:
        """The replica whose engine holds the last full block of ``tokens`` (it computed the request)."""
        deadline = time.monotonic() + timeout_s
        while True:
            owners = self.owners(tokens)
            if owners and owners[-1]:
                return sorted(owners[-1])[0] if len(owners[-1]) == 1 else None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def complete(prompt: str | list[int], max_tokens: int = 1, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[Usage, float]:
    """One completion of a text or token-id prompt: its usage and its latency in seconds."""
    import requests

    body: dict[str, JsonValue] = {
        "model": MODEL_ID,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    r = requests.post(URL, json=body, timeout=timeout_s)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return usage_of(section(as_json(r.json())).get("usage")), seconds


def _warm_up(replicas: int) -> None:
    """One-off kernel set-up on every replica (short text prompts no trace request shares)."""
    failures: list[BaseException] = []

    def one(prompt: str) -> None:
        try:
            complete(prompt)
        except Exception as e:  # noqa: BLE001 - re-raised below
            failures.append(e)

    prompts = [f"warm-up {i}: " + "kernel set-up " * 30 for i in range(3 * replicas)]
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"the app failed warm-up requests: {failures[0]!r}")


def leading_blocks_shared(a: list[int], b: list[int]) -> int:
    """Full blocks (``BLOCK`` tokens) ``a`` and ``b`` begin with alike."""
    n = 0
    while (n + 1) * BLOCK <= min(len(a), len(b)) and a[n * BLOCK : (n + 1) * BLOCK] == b[n * BLOCK : (n + 1) * BLOCK]:
        n += 1
    return n


#: How long after a request answered its engine's KV events may still be on their way to
#: the directory (``credit_same_engine``); the directory's own answer is trusted past it.
EVENT_LAG_S = 2.0


def credit_same_engine(results: list[RequestRecord], sessions: list[Session]) -> None:
    """Count as engine-cache hits the cached blocks its serving engine had.

    ``_drive`` reads each engine's holdings from the directory just before it sends, and
    an engine's KV events reach the directory a little later: a first turn sent 10 ms
    after another of its tenant answered on the same replica, or sent together with one
    that got the replica's first chunk computed before it, showed its hit on those blocks
    as a raykv load. So a request's cached blocks it shares with another request on its
    replica are the engine's (vLLM takes its own cache's blocks first) when that request
    answered before this one was sent (at most ``EVENT_LAG_S`` before: past that the
    directory's reading stands); or, when it was still computing then, if more were
    cached than any other replica's request answered before this one could have put in
    raykv. Never more than the request's cached tokens. (Blocks the engine evicted within
    those seconds would count as its hits: the shared blocks are its most recent.)"""
    tokens = {(s.index, t): toks for s in sessions for t, toks in enumerate(s.tokens)}

    def answered(r: RequestRecord) -> float:
        return r.get("sent", 0.0) + r["ttft_ms"] / 1000

    for r in results:
        if not r["replica"] or r["cached_tokens"] <= r["engine_hit_tokens"] or "sent" not in r:
            continue
        mine, sent, end = tokens[(r["session"], r["turn"])], r["sent"], answered(r)
        done = live = other = 0
        for p in results:
            if p is r or "sent" not in p:
                continue
            shared = leading_blocks_shared(mine, tokens[(p["session"], p["turn"])])
            if p["replica"] != r["replica"]:
                if answered(p) < end:
                    other = max(other, shared)
            elif sent - EVENT_LAG_S < answered(p) <= sent:
                done = max(done, shared)
            elif p["sent"] < end and answered(p) > sent:
                live = max(live, shared)
        blocks = done
        if live > other and r["cached_tokens"] > other * BLOCK:
            blocks = max(blocks, live)
        r["engine_hit_tokens"] = min(r["cached_tokens"], max(r["engine_hit_tokens"], blocks * BLOCK))


def _drive(sessions: list[Session], concurrency: int, watch: EngineWatch, progress: Progress) -> list[RequestRecord]:
    """Run the sessions, ``concurrency`` at a time (late ones once half the requests are done)."""
    total = sum(len(s.turns) for s in sessions)
    results: list[RequestRecord] = []
    failed: list[int] = []
    lock = threading.Lock()
    half_done = threading.Event()
    queue = sorted(sessions, key=lambda s: s.late)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                session = queue.pop(0)
            if session.late:
                half_done.wait()
            for turn, (prompt, tokens) in enumerate(zip(session.turns, session.tokens)):
                before = watch.leading(tokens)
                sent = time.perf_counter()
                try:
                    usage, seconds = complete(prompt)
                except Exception:  # noqa: BLE001 - counted; the session goes on
                    with lock:
                        failed.append(session.index)
                    progress.update(1)
                    continue
                by = watch.computed_by(tokens)
                cached = usage.cached_tokens
                engine_hit = min(cached, before.get(by, 0) * BLOCK) if by else 0
                with lock:
                    results.append(
                        {
                            "session": session.index,
                            "turn": turn,
                            "replica": by,
                            "prompt_tokens": usage.prompt_tokens,
                            "cached_tokens": cached,
                            "engine_hit_tokens": engine_hit,
                            "engine_hit_tokens_listed": engine_hit,
                            "ttft_ms": seconds * 1000,
                            "sent": sent,
                            "at": time.perf_counter(),
                        }
                    )
                    if len(results) * 2 >= total:
                        half_done.set()
                progress.update(1)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        r["at"] -= t0
        r["sent"] -= t0
    if failed:
        raise RuntimeError(f"{len(failed)} of {total} requests failed or timed out")
    return results


def _summary(results: list[RequestRecord], oracle: int, replicas: int) -> RouterSummary:
    """The figures of one router's ``results``; ``replicas`` the app had (those that served no
    request count in the load figures as 0, so that a router that leaves one idle does not
    look balanced)."""
    ttft = [r["ttft_ms"] for r in results]
    engine = sum(r["engine_hit_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    wall = max((r["at"] for r in results), default=0.0)
    per_replica = Counter(r["replica"] for r in results if r["replica"])
    loads = sorted(per_replica.values(), reverse=True)
    loads += [0] * (replicas - len(loads))
    mean = sum(loads) / len(loads) if loads else float("nan")
    return {
        "engine_hit_tokens": engine,
        "raykv_hit_tokens": cached - engine,
        "recomputed_tokens": prompt - cached,
        "prompt_tokens": prompt,
        "oracle_share": oracle_share(engine, cached - engine, oracle),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "requests_per_s": len(results) / wall if wall else float("nan"),
        "max_load_share": loads[0] / mean if per_replica else float("nan"),
        "requests_per_replica": loads,
        "unattributed_requests": sum(1 for r in results if not r["replica"]),
        "requests": results,
    }


def oracle_share(engine_hit: int, raykv_hit: int, oracle: int) -> dict[str, float]:
    """Hit tokens by source as shares of the oracle's: the engine's own cache, raykv's
    tiers, and the rest of the oracle's hit tokens, which were recomputed."""
    if oracle <= 0:
        return {"engine_hit": float("nan"), "raykv_hit": float("nan"), "recomputed": float("nan"), "hits": float("nan")}
    return {
        "engine_hit": engine_hit / oracle,
        "raykv_hit": raykv_hit / oracle,
        "recomputed": max(0, oracle - engine_hit - raykv_hit) / oracle,
        "hits": (engine_hit + raykv_hit) / oracle,
    }


def _targets(per: dict[str, RouterSummary | Failed]) -> list[Report]:
    out = []
    ok = {name: r for name, r in per.items() if "error" not in r}
    for name, r in ok.items():
        out.append(
            target(
                f"hit tokens / the oracle's, {name} router",
                r["oracle_share"]["hits"],
                0.9,
                detail=f"{r['engine_hit_tokens'] + r['raykv_hit_tokens']} of the oracle's hit tokens",
            )
        )
    d, p, k = (ok.get(n) for n in ROUTERS)
    if k:  # issue 24: engine-cache hits against the oracle (a ratio to the default router's was unreachable)
        out.append(
            target(
                "engine-cache hit tokens / the oracle's, raykv router",
                k["oracle_share"]["engine_hit"],
                0.95,
                detail=f"{k['engine_hit_tokens']} engine-cache hit tokens",
            )
        )
        p50 = k.get("router_decision_p50_ms")
        if p50 is not None:
            out.append(target("raykv router decision p50 ms (histogram buckets)", p50, 2.0, higher_is_better=False))
    if d and k:
        out.append(
            target(
                "TTFT p50, default router / raykv router",
                d["ttft_p50_ms"] / k["ttft_p50_ms"],
                1.3,
                detail=f"{d['ttft_p50_ms']:.1f} vs {k['ttft_p50_ms']:.1f} ms",
            )
        )
    if p and k:
        out.append(
            target(
                "TTFT p50, prefix-affinity router / raykv router",
                p["ttft_p50_ms"] / k["ttft_p50_ms"],
                1 / 0.9,  # raykv's <= 0.9x prefix affinity's
                detail=f"{p['ttft_p50_ms']:.1f} vs {k['ttft_p50_ms']:.1f} ms",
            )
        )
    if k:
        out.append(
            target("busiest replica's requests / mean, raykv router", k["max_load_share"], 1.5, higher_is_better=False)
        )
    return out


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def format_result(result: RoutingResult) -> str:
    rows: list[list[object]] = []
    for name, r in result["routers"].items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"][:60], *[""] * 9])
            continue
        share = r["oracle_share"]
        rows.append(
            [
                name,
                r["engine_hit_tokens"],
                r["raykv_hit_tokens"],
                r["recomputed_tokens"],
                _pct(share["engine_hit"]),
                _pct(share["raykv_hit"]),
                _pct(share["recomputed"]),
                r.get("cascade_dropped_blocks", ""),
                f"{r['ttft_p50_ms']:.1f}",
                f"{r['ttft_p99_ms']:.1f}",
                f"{r['requests_per_s']:.2f}",
                f"{r['max_load_share']:.2f}",
            ]
        )
    head = (
        f"raykv bench routing: {result['replicas']} replicas, {result['sessions']} sessions x {result['turns']} turns, "
        f"{result['tenants']} tenants, {result['concurrency']} sessions at a time "
        f"({result['requests']} requests per router); model {result['model']}, engine cache "
        f"{result['engine_blocks']} blocks, CPU primary {result['primary_chunks']} chunks per replica; "
        f"the oracle hits {result['oracle_hit_tokens']} tokens"
    )
    options = result.get("router_options") or {}
    if options:
        head += "; raykv router " + ", ".join(f"{k}={v:g}" for k, v in options.items())
    body = table(
        [
            "router",
            "engine hit tok",
            "raykv hit tok",
            "recomputed tok",
            "engine % oracle",
            "raykv % oracle",
            "recomputed % oracle",
            "dropped blocks",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "req/s",
            "max load share",
        ],
        rows,
    )
    ours = result["routers"].get("raykv")
    summary = ours if ours is not None and "error" not in ours else None
    cost = summary.get("router_ms_per_request") if summary is not None else None
    stages = summary.get("router_stage_ms", {}) if summary is not None else {}
    split = ", ".join(f"{stage} {ms:.2f}" for stage, ms in stages.items())
    note = f"raykv router: {cost:.2f} ms per decision ({split or 'tokenize, hash, directory, rank'})" if cost else ""
    p50 = summary.get("router_decision_p50_ms") if summary is not None else None
    p99 = summary.get("router_decision_p99_ms") if summary is not None else None
    if note and p50 is not None and p99 is not None:
        note += f"; p50 {p50:.2f} ms, p99 {p99:.2f} ms (from the histogram's buckets)"
    cpu = summary.get("router_cpu_ms_per_request") if summary is not None else None
    if note and cpu is not None:
        note += f"; its thread's CPU {cpu:.2f} ms per decision (the rest is waiting for a core)"
    legend = (
        "% oracle: hit tokens by source as shares of the oracle's (one unbounded cluster-wide cache); "
        "recomputed: the oracle's hit tokens that were recomputed. dropped blocks: blocks a replica computed "
        "that its full CPU primary refused, so vLLM's cascade offered them to no raykv tier."
    )
    return "\n\n".join(filter(None, [head, body, legend, note, targets_table(result["targets"])]))
