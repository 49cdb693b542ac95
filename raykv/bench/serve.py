"""``raykv bench serve``: serving throughput and latency of a Ray Serve LLM app, with and without raykv.

An embedded cluster (``ray.cluster_utils.Cluster``, one simulated node per
replica) runs a Serve LLM app of N vLLM replicas (the local bench model on CPU,
whose prefill costs what a real model's does per byte of KV; ``--tiny`` for the
tiny model, or ``--model``), once per configuration, each from empty caches:

- ``no_raykv``: Serve's default router (power of two choices), plain vLLM: its
  own prefix cache, no offload of any kind (no CPU offload either);
- ``prefix_affinity``: Ray's ``PrefixCacheAffinityRouter``, plain vLLM;
- ``raykv_tiers``: Serve's default router; vLLM's offloading connector with a
  CPU primary per replica (sized as a deployment sizes it,
  ``raykv.demo.replicas.deployment_primary_chunks``, or ``--primary-chunks``)
  cascading to raykv's tiers (each node's object store, a shared fs root);
- ``raykv``: the raykv router (it turns on the engines' KV events) + the same tiers.

Every configuration gets the same workload through the app's OpenAI endpoint
(``/v1/completions``, ``stream: true``), ``--concurrency`` jobs in flight: a job
is either one shared-prefix prompt (``--prompts`` prompts over ``--prefixes``
shared prefixes of ``--prefix-tokens`` tokens, each with its own
``--suffix-tokens`` suffix) or one multi-turn session (``--sessions`` sessions
of ``--turns`` turns, each turn sent as soon as the one before has answered,
sessions of ``--tenants`` tenants sharing their tenant's system prompt). Each
request asks for ``--output-tokens`` tokens (``ignore_eos``), so decode is
measured as well as prefill. Serve's stream batching is off
(``stream_batching_interval_ms: 0``): the client sees each token when the
engine makes it.

Measured by the client per request: TTFT (the first streamed token), end-to-end
latency, time per output token (the time from the first token to the last over
the tokens after the first). Per configuration: their percentiles, requests/s
and output tokens/s over the run's wall time, and the prompt's cached tokens by
source from vLLM's own counters (``vllm:prompt_tokens_cached_by_source``:
``device`` is the serving engine's own cache, the rest came through the
offloading connector: raykv's tiers with vLLM's CPU primary), with the trace's
oracle (one unbounded cluster-wide cache, ``raykv.demo.workload``) and each
source's share of it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, final

from typing_extensions import NotRequired  # typing has it from Python 3.11

from raykv.bench.common import (
    Failed,
    Tokenizer,
    at_least,
    bad_option,
    decode,
    fill_defaults,
    machine,
    names_option,
    number,
    percentile,
    section,
    table,
    target,
    targets_table,
)
from raykv.bench.routing import BLOCK, METRICS_SETTLE_S, oracle_share, primary_chunks, usage_of
from raykv.bench.serve_app import ENGINE_BLOCKS
from raykv.core.wire import JsonValue, Report
from raykv.demo.models import resolve_model
from raykv.demo.replicas import PRIMARY_PER_ENGINE_BLOCK

if TYPE_CHECKING:
    from raykv.demo.replicas import Progress
    from raykv.services.cluster import RaykvServices

HELP = "a Serve LLM app with and without raykv under concurrent streaming traffic: TTFT, TPOT, requests/s, hits"

#: name -> (Serve router, raykv attached, what it is)
CONFIGS: dict[str, tuple[str, bool, str]] = {
    "no_raykv": ("default", False, "no raykv: Serve's default router, vLLM with no offload"),
    "prefix_affinity": ("prefix_affinity", False, "Ray's prefix-affinity router, no raykv"),
    "raykv_tiers": ("default", True, "raykv tiers, Serve's default router"),
    "raykv": ("raykv", True, "raykv router + raykv tiers"),
}
APP_NAME = "raykv-bench-serve"
#: Seconds a request may go without a byte from the app before it counts as failed.
REQUEST_TIMEOUT_S = 120
#: vLLM's counter of cached prompt tokens by the tier that supplied them, as Ray exports it.
CACHED_BY_SOURCE = "ray_vllm_prompt_tokens_cached_by_source"
#: Sources of that counter that are the serving engine's own KV cache.
ENGINE_SOURCE = "device"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, help="vLLM replicas, one per simulated node (default 3; quick 2)")
    p.add_argument("--concurrency", type=int, help="jobs (prompts or sessions) in flight (default 4; quick 2)")
    p.add_argument("--prefixes", type=int, help="shared prefixes (default 12; quick 2)")
    p.add_argument("--prefix-tokens", type=int, help="tokens of each shared prefix (default 1000; quick 300)")
    p.add_argument("--suffix-tokens", type=int, default=64, help="tokens of each prompt's own suffix (default 64)")
    p.add_argument("--prompts", type=int, help="shared-prefix prompts, spread over the prefixes (120; quick 4)")
    p.add_argument("--sessions", type=int, help="multi-turn sessions (default 12; quick 2)")
    p.add_argument("--turns", type=int, help="turns per session (default 3; quick 2)")
    p.add_argument("--tenants", type=int, help="tenants of the sessions, each a system prompt (default 3; quick 2)")
    p.add_argument("--output-tokens", type=int, help="tokens generated per request (default 8; quick 4)")
    p.add_argument(
        "--model",
        help="'bench' (default: the local bench model, prefill priced like a real model's), "
        "'tiny' (the tiny local model; the default with --quick), or a model directory",
    )
    p.add_argument("--tiny", action="store_true", help="the tiny local model (same as --model tiny)")
    p.add_argument(
        "--primary-chunks",
        type=int,
        help="chunks (blocks) of each replica's vLLM CPU primary in the raykv configurations (default: "
        f"raykv.demo.replicas.deployment_primary_chunks: {PRIMARY_PER_ENGINE_BLOCK} x {ENGINE_BLOCKS} blocks)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")


#: Defaults of the options ``--quick`` changes (``fill_defaults``: a given option wins).
FULL = {
    "replicas": 3,
    "concurrency": 4,
    "prefixes": 12,
    "prefix_tokens": 1000,
    "prompts": 120,
    "sessions": 12,
    "turns": 3,
    "tenants": 3,
    "output_tokens": 8,
}
QUICK = {
    "replicas": 2,
    "concurrency": 2,
    "prefixes": 2,
    "prefix_tokens": 300,
    "prompts": 4,
    "sessions": 2,
    "turns": 2,
    "tenants": 2,
    "output_tokens": 4,
}


# ---------------------------------------------------------------- workload


@dataclass
class Job:
    """What one client slot runs: one shared-prefix prompt, or one session's turns in order."""

    kind: str  # "prefix" or "session"
    index: int  # the prefix prompt's or the session's number
    group: int  # the shared prefix, or the session's tenant
    prompts: list[str]  # text: Ray's prefix-affinity router reads text only
    tokens: list[list[int]]  # the same prompts as the model's tokenizer splits them (what engines hash)


class RequestRecord(TypedDict):
    """One streamed request (``stream_completion``), then where ``drive`` sent it from."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_ms: float
    e2e_ms: float
    tpot_ms: float | None  # None: one output token
    kind: NotRequired[str]  # the job's kind, its number, the turn, when it finished (``drive``)
    job: NotRequired[int]
    turn: NotRequired[int]
    done_s: NotRequired[float]


@final  # so that ``"error" in c`` tells a failure (``Failed``) from a summary
class ConfigSummary(TypedDict):
    """One configuration's figures (``summary``, then ``_run_config``'s additions)."""

    requests: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cached_share: float
    engine_hit_tokens: int | None  # None: unknown
    raykv_hit_tokens: int | None
    recomputed_tokens: int
    hit_tokens_by_source: dict[str, int]
    oracle_share: dict[str, float] | dict[str, float | None]
    ttft_p50_ms_by_kind: dict[str, float]
    cpu_s_by_role: NotRequired[dict[str, float]]
    cpu_s_per_request: NotRequired[dict[str, float]]
    router: NotRequired[str]
    raykv: NotRequired[bool]
    metrics_cached_tokens: NotRequired[int | None]
    router_ms_per_request: NotRequired[float | None]
    router_stage_ms: NotRequired[dict[str, float]]
    cascade_dropped_blocks: NotRequired[int]


class Workload(TypedDict):
    prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    prompts: int
    sessions: int
    turns: int
    tenants: int
    seed: int


class ServeResult(TypedDict):
    """The JSON result of ``raykv bench serve``."""

    benchmark: str
    machine: Report
    model: str
    replicas: int
    concurrency: int
    output_tokens: int
    workload: Workload
    requests: int
    engine_blocks: int
    primary_chunks: int
    cpu_bytes: int
    oracle_hit_tokens: int
    configs: dict[str, ConfigSummary | Failed]
    targets: list[Report]


def build_jobs(
    tokenizer: Tokenizer,
    *,
    prefixes: int,
    prefix_tokens: int,
    suffix_tokens: int,
    prompts: int,
    sessions: int,
    turns: int,
    tenants: int,
    seed: int = 7,
) -> list[Job]:
    """The workload in the order its jobs start: ``prompts`` one-turn prompts, prompt ``i``
    on prefix ``i % prefixes`` with a suffix of its own, and ``sessions`` multi-turn
    sessions (``raykv.bench.routing.build_sessions``), shuffled together by ``seed``."""
    from raykv.bench.routing import build_sessions
    from raykv.demo.tiny_model import make_prompt_tokens

    if prompts and prefixes < 1:
        raise bad_option(f"--prefixes: at least 1 with prompts, got {prefixes}")

    def text(n_tokens: int, s: int) -> str:
        return decode(tokenizer, make_prompt_tokens(n_tokens, s))

    shared = [text(prefix_tokens, 80_000 + p) for p in range(prefixes)] if prompts else []
    jobs = []
    for i in range(prompts):
        prompt = shared[i % prefixes] + "\n" + text(suffix_tokens, 90_000 + i)
        jobs.append(Job("prefix", i, i % prefixes, [prompt], [list(tokenizer.encode(prompt))]))
    if sessions:
        for s in build_sessions(sessions, turns, tenants, tokenizer, seed=seed):
            jobs.append(Job("session", s.index, s.tenant, s.turns, s.tokens))
    random.Random(seed).shuffle(jobs)
    return jobs


def oracle_hit_tokens(jobs: Sequence[Job]) -> int:
    """Prompt tokens the workload's oracle hits: one unbounded cluster-wide cache that
    sees the prompts one after another in job order (each session's turns in order)."""
    from raykv.demo import workload

    sent = [tokens for job in jobs for tokens in job.tokens]
    trace = [workload.TraceRequest(i, 0, 0, 0, tokens) for i, tokens in enumerate(sent)]
    return workload.oracle_hit_tokens(trace, BLOCK)


# ---------------------------------------------------------------- client


def stream_completion(url: str, body: dict[str, JsonValue], timeout_s: float = REQUEST_TIMEOUT_S) -> RequestRecord:
    """POST ``body`` with ``stream: true`` to an OpenAI completions endpoint and time the
    stream as it arrives: TTFT (first chunk carrying a choice), end to end, time per
    output token after the first, and the usage of the final chunk."""
    parts = urllib.parse.urlsplit(url)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    first = last = None
    chunks = 0
    usage: Report = {}
    t0 = time.perf_counter()
    try:
        conn.request("POST", parts.path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = section(json.loads(data))
            if msg.get("error"):
                raise RuntimeError(f"stream error: {str(msg['error'])[:300]}")
            if msg.get("choices"):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                chunks += 1
            if msg.get("usage"):
                usage = section(msg["usage"])
    finally:
        conn.close()
    end = time.perf_counter()
    if first is None or last is None:
        raise RuntimeError("the stream carried no token")
    output = int(number(usage.get("completion_tokens")) or chunks)
    prompt, cached = usage_of(usage)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "ttft_ms": (first - t0) * 1000,
        "e2e_ms": (end - t0) * 1000,
        "tpot_ms": (last - first) * 1000 / (output - 1) if output > 1 else None,
    }


def drive(
    jobs: Sequence[Job],
    concurrency: int,
    send: Callable[[str], RequestRecord],
    progress: Progress | None = None,
) -> tuple[list[RequestRecord], float, int]:
    """Run ``jobs``, ``concurrency`` at a time, in order; a session's next turn goes as soon
    as the one before has answered. Returns the requests' records (``send``'s, with the
    job's kind and the time it finished), the wall time in seconds and the failures."""
    queue = list(jobs)
    records: list[RequestRecord] = []
    failed = 0
    lock = threading.Lock()
    t0 = time.perf_counter()

    def worker() -> None:
        nonlocal failed
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop(0)
            for turn, prompt in enumerate(job.prompts):
                try:
                    rec = send(prompt)
                except Exception:  # noqa: BLE001 - counted; the job goes on
                    with lock:
                        failed += 1
                else:
                    rec["kind"], rec["job"], rec["turn"] = job.kind, job.index, turn
                    rec["done_s"] = time.perf_counter() - t0
                    with lock:
                        records.append(rec)
                if progress is not None:
                    progress.update(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0, failed


# ---------------------------------------------------------------- stats


def summary(
    records: Sequence[RequestRecord],
    wall_s: float,
    oracle: int,
    engine_hit: int | None,
    by_source: dict[str, int] | None = None,
) -> ConfigSummary:
    """One configuration's figures from its requests' records. ``engine_hit``: prompt
    tokens that came from the serving engine's own cache (None: unknown); the rest of
    the cached tokens came through raykv (tiers and vLLM's CPU primary)."""
    ttft = [r["ttft_ms"] for r in records]
    e2e = [r["e2e_ms"] for r in records]
    tpot = [t for r in records if (t := r["tpot_ms"]) is not None]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    output = sum(r["output_tokens"] for r in records)
    raykv_hit = None if engine_hit is None else max(0, cached - engine_hit)
    share: dict[str, float] | dict[str, float | None] = (
        oracle_share(engine_hit, raykv_hit, oracle)
        if engine_hit is not None and raykv_hit is not None
        else {"engine_hit": None, "raykv_hit": None, "recomputed": None, "hits": cached / oracle if oracle else None}
    )
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s if wall_s > 0 else float("nan"),
        "output_tokens_per_s": output / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else float("nan"),
        "engine_hit_tokens": engine_hit,
        "raykv_hit_tokens": raykv_hit,
        "recomputed_tokens": prompt - cached,
        "hit_tokens_by_source": dict(by_source or {}),
        "oracle_share": share,
        "ttft_p50_ms_by_kind": {
            kind: percentile([r["ttft_ms"] for r in records if r.get("kind") == kind], 50)
            for kind in sorted({r["kind"] for r in records if r.get("kind")})
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a != a or b != b or b == 0:
        return None
    return a / b


#: The figures of two configurations that a target compares.
Figure = Literal["requests_per_s", "ttft_p50_ms", "tpot_p50_ms"]


def targets(configs: dict[str, ConfigSummary | Failed]) -> list[Report]:
    """Issue 21's targets, from the configurations that ran."""
    ok = {name: c for name, c in configs.items() if "error" not in c}
    base, affinity, tiers, full = (ok.get(n) for n in ("no_raykv", "prefix_affinity", "raykv_tiers", "raykv"))
    out = []

    def versus(name: str, key: Figure, a: ConfigSummary, b: ConfigSummary, threshold: float, higher: bool) -> None:
        out.append(
            target(
                name,
                _ratio(a[key], b[key]),
                threshold,
                higher_is_better=higher,
                detail=f"{a[key]:.2f} vs {b[key]:.2f}",
            )
        )

    if full and base:
        versus("requests/s, raykv router + tiers / no raykv", "requests_per_s", full, base, 1.2, True)
        versus("TTFT p50, raykv router + tiers / no raykv", "ttft_p50_ms", full, base, 0.7, False)
    if full and affinity:
        versus("requests/s, raykv router + tiers / prefix-affinity", "requests_per_s", full, affinity, 1.0, True)
        versus("TTFT p50, raykv router + tiers / prefix-affinity", "ttft_p50_ms", full, affinity, 0.9, False)
    if full and base:
        versus("TPOT p50, raykv router + tiers / no raykv", "tpot_p50_ms", full, base, 1.1, False)
    if tiers and base:
        versus("TPOT p50, raykv tiers (default router) / no raykv", "tpot_p50_ms", tiers, base, 1.1, False)
    return out


# ---------------------------------------------------------------- metrics


def vllm_cached_by_source(model_id: str) -> dict[str, int]:
    """vLLM's cached prompt tokens by source (``device``, ``host``, ``disk``, ...) over the
    replicas serving ``model_id``, from every node's Ray metrics."""
    import ray

    from raykv.metrics.scrape import parse_prometheus

    out: Counter[str] = Counter()
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics", timeout=5) as r:
                series = parse_prometheus(r.read().decode(), prefix=CACHED_BY_SOURCE)
        except OSError:
            continue
        for name, labels, value in series:
            if name.removesuffix("_total") == CACHED_BY_SOURCE and labels.get("model_name") == model_id:
                out[labels.get("source", "?")] += int(value)
    return dict(out)


def settled_cached_by_source(model_id: str, at_least: int = 0, timeout_s: float = 60.0) -> dict[str, int]:
    """``vllm_cached_by_source`` once it counts ``at_least`` tokens in all and two reads
    ``METRICS_SETTLE_S`` apart agree (Ray exports a process's metrics every few seconds)."""
    deadline = time.monotonic() + timeout_s
    last = vllm_cached_by_source(model_id)
    while time.monotonic() < deadline:
        time.sleep(METRICS_SETTLE_S)
        now = vllm_cached_by_source(model_id)
        if now == last and sum(now.values()) >= at_least:
            return now
        last = now
    return last


# ---------------------------------------------------------------- run


def _configs(args: argparse.Namespace) -> list[str]:
    return names_option("--configs", args.configs, list(CONFIGS))


def run(args: argparse.Namespace) -> ServeResult:
    """Run the workload under each configuration; returns the JSON result."""
    import ray
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from raykv.bench.serve_app import start_cluster
    from raykv.demo.replicas import chunk_bytes
    from raykv.integrations.vllm import require_vllm

    fill_defaults(args, FULL, QUICK)
    at_least(1, replicas=args.replicas, concurrency=args.concurrency, output_tokens=args.output_tokens)
    require_vllm()
    names = _configs(args)
    chunks = primary_chunks(args)
    model, model_name = resolve_model(args)
    cpu_bytes = chunks * chunk_bytes(model)
    jobs = build_jobs(
        AutoTokenizer.from_pretrained(model),
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        prompts=args.prompts,
        sessions=args.sessions,
        turns=args.turns,
        tenants=args.tenants,
        seed=args.seed,
    )
    requests_total = sum(len(j.prompts) for j in jobs)
    oracle = oracle_hit_tokens(jobs)
    info = machine()
    cluster = start_cluster(args.replicas, model)
    url = _start_serve()
    progress = tqdm(total=len(names) * requests_total, file=sys.stderr, disable=args.no_progress, unit="req")
    per: dict[str, ConfigSummary | Failed] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="raykv-bench-serve-") as root:
            for name in names:
                try:
                    per[name] = _run_config(name, model, f"{root}/{name}", url, args, jobs, progress, cpu_bytes, oracle)
                except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
                    per[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        progress.close()
        ray.shutdown()  # and the cluster with Serve in it (serve.shutdown() would print on stdout)
        cluster.shutdown()
    return {
        "benchmark": "serve",
        "machine": info,
        "model": model_name,
        "replicas": args.replicas,
        "concurrency": args.concurrency,
        "output_tokens": args.output_tokens,
        "workload": {
            "prefixes": args.prefixes,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "prompts": args.prompts,
            "sessions": args.sessions,
            "turns": args.turns,
            "tenants": args.tenants,
            "seed": args.seed,
        },
        "requests": requests_total,
        "engine_blocks": ENGINE_BLOCKS,
        "primary_chunks": chunks,
        "cpu_bytes": cpu_bytes,
        "oracle_hit_tokens": oracle,
        "configs": per,
        "targets": targets(per),
    }


def _run_config(
    name: str,
    model: str,
    root: str,
    url: str,
    args: argparse.Namespace,
    jobs: Sequence[Job],
    progress: Progress,
    cpu_bytes: int,
    oracle: int,
) -> ConfigSummary:
    from ray import serve

    import raykv
    from raykv.bench.cpu import cpu_by_role, cpu_delta, cpu_per_request
    from raykv.bench.routing import _router_cost_ms, _router_totals, cascade_drops
    from raykv.bench.serve_app import bench_app

    router, attached, _ = CONFIGS[name]
    model_id = f"bench-{name.replace('_', '-')}"  # vLLM labels its metrics by it: one series set per config
    namespace = f"raykv-bench-serve-{name.replace('_', '-')}"
    services = raykv.start({"namespace": namespace, "directory_shards": 2}) if attached else None
    raykv_cfg: dict[str, JsonValue] = {
        "namespace": namespace,
        "tiers": [{"type": "object_store"}, {"type": "fs", "root": root}],
    }
    app = bench_app(
        model,
        model_id=model_id,
        replicas=args.replicas,
        router=router,
        raykv=raykv_cfg if attached else False,
        cpu_bytes=cpu_bytes,
        engine_kwargs={"disable_log_stats": False},  # vLLM's counters: cached tokens by source
        experimental_configs={"stream_batching_interval_ms": 0},  # each token when the engine makes it
    )
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        _wait_running(APP_NAME, url)
        if services is not None and router == "raykv":  # it routes by the engines' caches in the directory
            _wait_engines(services, args.replicas)
        warm_up(url, model_id, args.replicas)
        before = settled_cached_by_source(model_id)
        cost_before = _router_totals() if name == "raykv" else None
        body: dict[str, JsonValue] = {
            "model": model_id,
            "max_tokens": args.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        cpu_before = cpu_by_role()
        records, wall_s, failed = drive(
            jobs, args.concurrency, lambda prompt: stream_completion(url, {**body, "prompt": prompt}), progress
        )
        cpu_spent = cpu_delta(cpu_before, cpu_by_role())
        if failed:
            raise RuntimeError(f"{failed} of {sum(len(j.prompts) for j in jobs)} requests failed or timed out")
        # the client was told how many tokens were cached: wait for vLLM's counters to say as much
        after = settled_cached_by_source(model_id, sum(before.values()) + sum(r["cached_tokens"] for r in records))
        by_source = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        engine_hit = by_source.get(ENGINE_SOURCE, 0) if after else None
        if engine_hit is None and not attached:
            engine_hit = sum(r["cached_tokens"] for r in records)  # no connector: every hit is the engine's
        out = summary(records, wall_s, oracle, engine_hit, by_source)
        # every process of this host over the trace, raykv's roles per served request
        out["cpu_s_by_role"] = cpu_spent
        out["cpu_s_per_request"] = cpu_per_request(cpu_spent, len(records)) if records else {}
        out["router"] = router
        out["raykv"] = attached
        out["metrics_cached_tokens"] = sum(by_source.values()) if after else None  # vLLM's count: = cached_tokens
        if cost_before is not None:
            out["router_ms_per_request"], out["router_stage_ms"] = _router_cost_ms(cost_before)
        if attached:
            out["cascade_dropped_blocks"] = cascade_drops(namespace)
    finally:
        # delete the app, not Serve: killing Serve's controller prints Ray's warnings on
        # stdout, where --json writes its object
        serve.delete(APP_NAME)
        if services is not None:
            services.shutdown()
    return out


def _start_serve() -> str:
    """Start Serve on the connected cluster, its HTTP proxy on the head node only, on a port
    free right now (not 8000: a Serve test or app elsewhere on the host may hold that);
    returns the completions URL."""
    import socket

    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}/v1/completions"


def _wait_engines(services: RaykvServices, n: int, timeout_s: float = 300) -> None:
    """Until ``n`` engines have announced their caches to raykv's directory."""
    from raykv.core.placement import ENGINE

    deadline = time.monotonic() + timeout_s
    while sum(1 for h in services.holders() if h.medium == ENGINE) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} engines did not announce their caches in {timeout_s:.0f} s")
        time.sleep(1)


def warm_up(url: str, model_id: str, replicas: int) -> None:
    """One-off kernel set-up on every replica: short prompts no workload request shares
    (a few per replica at once, so every replica gets some)."""
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream_completion(
                url, {"model": model_id, "prompt": f"warm-up {i}: " + "kernel set-up " * 30, "max_tokens": 2}
            )
        except Exception as e:  # noqa: BLE001 - re-raised below
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3 * replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"the app failed warm-up requests: {failures[0]!r}")


def _wait_running(app: str, url: str, timeout_s: float = 600) -> None:
    """Wait until Serve reports ``app`` RUNNING (every replica up), and its HTTP endpoint answers."""
    from ray import serve

    models = url.rsplit("/", 1)[0] + "/models"
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app)
        state = str(getattr(status, "status", ""))
        if state.endswith("RUNNING"):
            try:
                with urllib.request.urlopen(models, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
        if state.endswith("DEPLOY_FAILED") or state.endswith("UNHEALTHY"):
            raise RuntimeError(f"the Serve app {app} is {state}: {getattr(status, 'message', '')[:300]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Serve app {app} was not running in {timeout_s:.0f} s ({state})")
        time.sleep(1)


# ---------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def format_result(result: ServeResult) -> str:
    w = result["workload"]
    head = (
        f"raykv bench serve: {result['replicas']} replicas (one per simulated node), model {result['model']}, "
        f"{result['concurrency']} jobs in flight, {result['output_tokens']} output tokens per request; "
        f"{w['prompts']} prompts over {w['prefixes']} shared {w['prefix_tokens']}-token prefixes "
        f"(+{w['suffix_tokens']}-token suffixes) and {w['sessions']} sessions x {w['turns']} turns "
        f"({w['tenants']} tenants): {result['requests']} requests per config; engine cache "
        f"{result['engine_blocks']} blocks, CPU primary {result['primary_chunks']} chunks per replica with raykv; "
        f"the oracle hits {result['oracle_hit_tokens']} tokens"
    )
    rows: list[list[object]] = []
    for name, c in result["configs"].items():
        if "error" in c:
            rows.append([name, "failed: " + c["error"][:70], *[""] * 11])
            continue
        share = c["oracle_share"]
        rows.append(
            [
                name,
                _ms(c["ttft_p50_ms"]),
                _ms(c["ttft_p99_ms"]),
                _ms(c["e2e_p50_ms"]),
                _ms(c["tpot_p50_ms"]),
                f"{c['requests_per_s']:.2f}",
                f"{c['output_tokens_per_s']:.1f}",
                _pct(c["cached_share"]),
                "-" if c["engine_hit_tokens"] is None else c["engine_hit_tokens"],
                "-" if c["raykv_hit_tokens"] is None else c["raykv_hit_tokens"],
                c["recomputed_tokens"],
                f"{_pct(share['engine_hit'])} / {_pct(share['raykv_hit'])}",
                c.get("cascade_dropped_blocks", "-"),
            ]
        )
    body = table(
        [
            "config",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "e2e p50 ms",
            "TPOT p50 ms",
            "req/s",
            "out tok/s",
            "cached",
            "engine hit tok",
            "raykv hit tok",
            "recomputed tok",
            "engine / raykv % oracle",
            "dropped blocks",
        ],
        rows,
    )
    legend = "configs: " + "; ".join(f"{n} = {CONFIGS[n][2]}" for n in result["configs"] if n in CONFIGS)
    legend += (
        ". cached: prompt tokens not recomputed. engine hit: from the serving engine's own cache; raykv hit: "
        "through vLLM's offloading connector (raykv's tiers and vLLM's CPU primary). % oracle: shares of the "
        "oracle's hit tokens (one unbounded cluster-wide cache). TPOT: time per output token after the first. "
        "dropped blocks: blocks a full CPU primary refused, so no raykv tier saw them."
    )
    ours = result["configs"].get("raykv")
    cost = ours.get("router_ms_per_request") if ours is not None and "error" not in ours else None
    note = f"raykv router: {cost:.2f} ms per decision" if cost else ""
    return "\n\n".join(filter(None, [head, body, legend, note, cpu_lines(result), targets_table(result["targets"])]))


def cpu_lines(result: ServeResult) -> str:
    """CPU ms per served request of each process role, one line per configuration
    (engines count whole: vLLM's compute too)."""
    lines = []
    for name, c in result["configs"].items():
        per = c.get("cpu_s_per_request") if "error" not in c else None
        if per:
            lines.append(f"  {name}: " + ", ".join(f"{role} {1000 * s:.1f}" for role, s in per.items()))
    return "CPU ms per served request, by process role:\n" + "\n".join(lines) if lines else ""
