"""``raykv bench overload``: a Serve LLM app under the raykv router, driven past its capacity.

An embedded cluster (``ray.cluster_utils.Cluster``, one simulated node per
replica; ``raykv.bench.serve_app``) runs a Serve LLM app of N vLLM replicas
under the raykv router with raykv's tiers (the ``raykv`` configuration of
``raykv bench serve``), once per scenario, each from fresh caches and a fresh
raykv namespace:

- ``healthy``: nothing injected;
- ``slow_shard``: directory shard 0 answers every call ``--shard-delay-ms`` late
  (500 ms; ``raykv.directory.shard.TESTING_DELAY_ENV`` in that shard actor's
  environment only, set when the shard is created);
- ``dead_shard``: directory shard 0 is killed (``ray.kill``, no restart) at
  ``--kill-at`` of the overload phase.

Each scenario first measures the app's capacity, closed loop: ``--capacity-
concurrency`` clients send one request after another for ``--capacity-s``
seconds; capacity = completed requests / s. Then the overload phase: open-loop
Poisson arrivals at ``--load`` (2.0) x the first scenario's capacity for
``--duration-s`` seconds; the sender never waits for an answer before the next
request. Requests are streamed ``/v1/completions`` calls (``raykv bench
serve``'s client) of prompts over shared prefixes.

Reported per second of the overload phase (by when each request ended):
completed requests, errors by cause, TTFT p50/p99; per scenario: the same in
total, and raykv's own figures over the phase from its Ray metrics: router
decisions and their time (histogram bound), engine steps' time inside raykv,
lookups that degraded to MISS. Error causes come from the HTTP status and body:
``backpressure`` (Serve: HTTP 503/429, "backpressure"), ``timeout`` (no byte for
``--request-timeout-s``, HTTP 408/504), ``raykv`` (the error names raykv),
``other``. Serve's queues are bounded (``--max-ongoing-requests`` per replica,
``--max-queued-requests``) so that overload shows as backpressure, as it would
in a deployment that protects its latency.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, final

from raykv.bench.common import (
    Failed,
    above_zero,
    at_least,
    bad_option,
    fill_defaults,
    machine,
    names_option,
    percentile,
    table,
    target,
    targets_table,
)
from raykv.core.wire import JsonValue, Report
from raykv.demo.models import resolve_model

if TYPE_CHECKING:
    from ray.serve import Application

    from raykv.services.cluster import RaykvServices

HELP = "a Serve LLM app (raykv router) at 2x its measured capacity, open loop: healthy, slow shard, dead shard"

#: scenario -> what it is
SCENARIOS: dict[str, str] = {
    "healthy": "nothing injected",
    "slow_shard": "directory shard 0 answers every call late",
    "dead_shard": "directory shard 0 killed during the overload phase, no restart",
}
CAUSES = ("backpressure", "timeout", "raykv", "other")
#: No "raykv" in it: errors that name the app must not read as raykv's.
APP_NAME = "overload-bench"
FAULT_SHARD = 0
DIRECTORY_SHARDS = 2
#: Seconds Ray takes to export a process's metrics (read after waiting this long).
METRICS_SETTLE_S = 6.0
ROUTER_DECISION = "ray_raykv_router_decision_seconds"
ENGINE_STEP = "ray_raykv_engine_step_seconds"
COUNTERS = {
    "lookups": "ray_raykv_lookups_total",
    "lookup_misses": "ray_raykv_lookup_misses_total",
    "retry_budget_misses": "ray_raykv_lookup_retry_budget_misses_total",
    "router_fallbacks": "ray_raykv_router_fallbacks_total",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, help="vLLM replicas, one per simulated node (default 2)")
    p.add_argument("--load", type=float, default=2.0, help="arrival rate as a multiple of capacity (default 2.0)")
    p.add_argument("--duration-s", type=float, help="seconds of the overload phase (default 180; quick 12)")
    p.add_argument("--capacity-s", type=float, help="seconds of the capacity phase (default 30; quick 8)")
    p.add_argument("--capacity-concurrency", type=int, help="closed-loop clients of it (default 4 per replica)")
    p.add_argument("--rate", type=float, help="arrivals/s of the overload phase (default: --load x capacity)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--shard-delay-ms", type=float, default=500.0, help="slow_shard: the delay (default 500)")
    p.add_argument("--kill-at", type=float, default=0.3, help="dead_shard: when, as a share of the phase (0.3)")
    p.add_argument("--max-ongoing-requests", type=int, default=8, help="Serve: per replica (default 8; 0: Serve's)")
    p.add_argument("--max-queued-requests", type=int, default=16, help="Serve: queued per handle (16; -1: unbounded)")
    p.add_argument("--request-timeout-s", type=float, help="no byte for this long: timeout (30; quick 20)")
    p.add_argument("--prefixes", type=int, help="shared prefixes (default 8; quick 2)")
    p.add_argument("--prefix-tokens", type=int, help="tokens of each shared prefix (default 512; quick 256)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="tokens of each prompt's own suffix (default 32)")
    p.add_argument("--prompts", type=int, help="distinct prompts, drawn at random per request (64; quick 8)")
    p.add_argument("--output-tokens", type=int, help="tokens generated per request (default 8; quick 4)")
    p.add_argument("--model", help="'bench' (default), 'tiny' (the default with --quick), or a model directory")
    p.add_argument("--tiny", action="store_true", help="the tiny local model (same as --model tiny)")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")


#: Defaults of the options ``--quick`` changes; an option given on the command line wins over both.
FULL: dict[str, float | int] = {
    "replicas": 2,
    "duration_s": 180.0,
    "capacity_s": 30.0,
    "prefixes": 8,
    "prefix_tokens": 512,
    "prompts": 64,
    "output_tokens": 8,
    "request_timeout_s": 30.0,
}
QUICK: dict[str, float | int] = {
    "replicas": 2,
    "duration_s": 12.0,
    "capacity_s": 8.0,
    "prefixes": 2,
    "prefix_tokens": 256,
    "prompts": 8,
    "output_tokens": 4,
    "request_timeout_s": 20.0,
}


# ---------------------------------------------------------------- pure parts


def poisson_schedule(rate: float, duration_s: float, seed: int = 7) -> list[float]:
    """Arrival times (seconds from 0, increasing, < ``duration_s``) of a Poisson process of ``rate``/s."""
    if rate <= 0 or duration_s <= 0:
        return []
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


_STATUS = re.compile(r"\bHTTP (\d{3})\b")


def classify(text: str, *, timed_out: bool = False, ignore: Iterable[str] = ()) -> str:
    """The cause of a failed request (one of ``CAUSES``) from its error's text (``HTTP <status>:
    <body>`` or an exception's) and whether the client timed out. ``ignore``: strings that may
    name raykv without being raykv's (the model's path under raykv's cache directory)."""
    for s in ignore:
        if s:
            text = text.replace(s, "")
    low = text.lower()
    found = _STATUS.search(text)
    status = int(found.group(1)) if found else None
    if "raykv" in low:
        return "raykv"
    if status in (503, 429) or "backpressure" in low:
        return "backpressure"
    if timed_out or status in (408, 504) or "timed out" in low:
        return "timeout"
    return "other"


@dataclass
class Outcome:
    """One request of an open- or closed-loop phase; times in seconds from the phase's start."""

    sent_s: float
    end_s: float
    ttft_ms: float | None  # None: failed
    cause: str | None = None  # None: completed
    error: str = ""


class Second(TypedDict):
    """One second of the overload phase (requests that ended in it)."""

    t: int
    completed: int
    errors: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


def _pct(xs: Sequence[float], q: float) -> float | None:
    return percentile(xs, q) if xs else None


def per_second(outcomes: Iterable[Outcome], seconds: int | None = None) -> list[Second]:
    """``outcomes`` bucketed by the whole second they ended in: completions, errors by cause,
    TTFT p50/p99 of the completions. ``seconds``: at least this many buckets (empty ones too)."""
    buckets: dict[int, list[Outcome]] = {}
    for o in outcomes:
        buckets.setdefault(max(0, int(o.end_s)), []).append(o)
    n = max([seconds or 0, *(k + 1 for k in buckets)])
    return [_second(t, buckets.get(t, [])) for t in range(n)]


def _second(t: int, outs: Sequence[Outcome]) -> Second:
    ttft = [o.ttft_ms for o in outs if o.cause is None and o.ttft_ms is not None]
    return {
        "t": t,
        "completed": len(ttft),
        "errors": {c: sum(1 for o in outs if o.cause == c) for c in CAUSES},
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
    }


def bucket_bound(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The smallest histogram bucket edge holding ``q`` (0..1) of the observations made between
    two reads of cumulative Prometheus buckets (``le`` -> count); None: no observation."""
    delta = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = max(delta.values(), default=0.0)
    if total <= 0:
        return None
    for le in sorted(delta):
        if delta[le] >= q * total:
            return le
    return math.inf


# ---------------------------------------------------------------- load


Send = Callable[[str], float]  # a prompt -> its TTFT in ms; raises on failure


def _attempt(send: Send, prompt: str, t0: float, ignore: Sequence[str]) -> Outcome:
    sent = time.perf_counter() - t0
    try:
        ttft = send(prompt)
    except Exception as e:  # noqa: BLE001 - every failure is counted by its cause
        text = f"{type(e).__name__}: {e}"
        cause = classify(text, timed_out=isinstance(e, TimeoutError), ignore=ignore)
        return Outcome(sent, time.perf_counter() - t0, None, cause, text[:300])
    return Outcome(sent, time.perf_counter() - t0, ttft)


def open_loop(
    schedule: Sequence[float],
    prompts: Sequence[str],
    send: Send,
    *,
    drain_s: float,
    ignore: Sequence[str] = (),
    seed: int = 7,
) -> tuple[list[Outcome], float]:
    """Send one request at each time of ``schedule`` (seconds from now), each on its own
    thread, never waiting for answers; then wait up to ``drain_s`` for the last ones (those
    still open count as timeouts). Returns the outcomes and the phase's start (perf_counter)."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(prompt: str) -> None:
        o = _attempt(send, prompt, t0, ignore)
        with lock:
            outcomes.append(o)

    threads = []
    for at in schedule:
        time.sleep(max(0.0, t0 + at - time.perf_counter()))  # not a wait on answers: the arrival clock
        th = threading.Thread(target=one, args=(rng.choice(prompts),), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.perf_counter() + drain_s
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    with lock:
        done = list(outcomes)
    end = time.perf_counter() - t0
    done += [Outcome(end, end, None, "timeout", "still open at the end")] * (len(schedule) - len(done))
    return done, t0


def closed_loop(prompts: Sequence[str], send: Send, concurrency: int, duration_s: float, seed: int = 7) -> float:
    """Capacity: ``concurrency`` clients each send one request after another for ``duration_s``;
    completed requests per second (until the last of them ended)."""
    rng = random.Random(seed)
    done: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def client() -> None:
        while time.perf_counter() - t0 < duration_s:
            with lock:
                prompt = rng.choice(prompts)
            o = _attempt(send, prompt, t0, ())
            with lock:
                done.append(o)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(max(1, concurrency))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = [o for o in done if o.cause is None]
    wall = max((o.end_s for o in done), default=0.0)
    return len(ok) / wall if wall > 0 else 0.0


# ---------------------------------------------------------------- results


class RaykvFigures(TypedDict):
    """raykv's own figures over the overload phase, from its Ray metrics (None: not measured)."""

    router_decisions: int | None
    router_decision_p99_le_s: float | None  # the histogram's bucket edge holding 99% of decisions
    router_decision_max_le_s: float | None
    engine_steps: int | None
    engine_step_p99_le_s: float | None
    engine_step_max_le_s: float | None
    lookups: int | None
    lookup_misses: int | None
    retry_budget_misses: int | None  # lookups answered MISS once the request's retry budget was spent
    router_fallbacks: int | None  # decisions left to power of two choices (e.g. a directory read failed)


@final  # so that ``"error" in s`` tells a failure (``Failed``) from a summary
class ScenarioResult(TypedDict):
    """One scenario's figures."""

    capacity_rps: float
    rate_rps: float
    duration_s: float
    sent: int
    completed: int
    completed_per_s: float
    errors: dict[str, int]
    error_share: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    fault_at_s: float | None  # dead_shard: when the shard was killed
    error_samples: dict[str, str]
    raykv: RaykvFigures
    per_second: list[Second]


class OverloadResult(TypedDict):
    """The JSON result of ``raykv bench overload``."""

    benchmark: str
    machine: Report
    model: str
    replicas: int
    load: float
    duration_s: float
    capacity_s: float
    capacity_concurrency: int
    rate_rps: float | None
    max_ongoing_requests: int
    max_queued_requests: int
    request_timeout_s: float
    shard_delay_ms: float
    kill_at: float
    workload: Report
    scenarios: dict[str, ScenarioResult | Failed]
    targets: list[Report]


def scenario_summary(outcomes: Sequence[Outcome], capacity: float, rate: float, duration_s: float) -> ScenarioResult:
    """A scenario's totals and per-second rows from its overload phase's outcomes."""
    ok = [o.ttft_ms for o in outcomes if o.cause is None and o.ttft_ms is not None]
    errors = {c: sum(1 for o in outcomes if o.cause == c) for c in CAUSES}
    samples = {c: next(o.error for o in outcomes if o.cause == c) for c in CAUSES if errors[c]}
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "duration_s": duration_s,
        "sent": len(outcomes),
        "completed": len(ok),
        "completed_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "errors": errors,
        "error_share": sum(errors.values()) / len(outcomes) if outcomes else 0.0,
        "ttft_p50_ms": _pct(ok, 50),
        "ttft_p99_ms": _pct(ok, 99),
        "fault_at_s": None,
        "error_samples": samples,
        "raykv": empty_figures(),
        "per_second": per_second(outcomes, math.ceil(duration_s)),
    }


def empty_figures() -> RaykvFigures:
    return {
        "router_decisions": None,
        "router_decision_p99_le_s": None,
        "router_decision_max_le_s": None,
        "engine_steps": None,
        "engine_step_p99_le_s": None,
        "engine_step_max_le_s": None,
        "lookups": None,
        "lookup_misses": None,
        "retry_budget_misses": None,
        "router_fallbacks": None,
    }


def targets(scenarios: dict[str, ScenarioResult | Failed]) -> list[Report]:
    """Issue 26's lines: no request fails because of raykv, in every scenario that ran."""
    out = []
    for name, s in scenarios.items():
        if "error" in s:
            out.append(target(f"{name}: raykv-caused errors", None, 0, higher_is_better=False, detail=s["error"][:80]))
            continue
        out.append(
            target(f"{name}: raykv-caused errors", s["errors"]["raykv"], 0, higher_is_better=False, detail="requests")
        )
    return out


# ---------------------------------------------------------------- metrics


@dataclass
class Metrics:
    """raykv's series summed over the cluster at one moment: plain values and histogram buckets."""

    sums: dict[str, float]
    buckets: dict[str, dict[float, float]]


def read_metrics() -> Metrics:
    from raykv.metrics.scrape import scrape_cluster

    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for name, labels, value in scrape_cluster():
        if name.endswith("_bucket") and "le" in labels:
            b = buckets.setdefault(name.removesuffix("_bucket"), {})
            le = float(labels["le"])
            b[le] = b.get(le, 0.0) + value
        else:
            sums[name] = sums.get(name, 0.0) + value
    return Metrics(sums, buckets)


def figures(before: Metrics, after: Metrics) -> RaykvFigures:
    """raykv's figures between two reads."""

    def count(name: str) -> int:
        return int(after.sums.get(name, 0.0) - before.sums.get(name, 0.0))

    def bound(name: str, q: float) -> float | None:
        return bucket_bound(before.buckets.get(name, {}), after.buckets.get(name, {}), q)

    return {
        "router_decisions": count(ROUTER_DECISION + "_count"),
        "router_decision_p99_le_s": bound(ROUTER_DECISION, 0.99),
        "router_decision_max_le_s": bound(ROUTER_DECISION, 1.0),
        "engine_steps": count(ENGINE_STEP + "_count"),
        "engine_step_p99_le_s": bound(ENGINE_STEP, 0.99),
        "engine_step_max_le_s": bound(ENGINE_STEP, 1.0),
        "lookups": count(COUNTERS["lookups"]),
        "lookup_misses": count(COUNTERS["lookup_misses"]),
        "retry_budget_misses": count(COUNTERS["retry_budget_misses"]),
        "router_fallbacks": count(COUNTERS["router_fallbacks"]),
    }


# ---------------------------------------------------------------- run


@dataclass
class Setup:
    """What every scenario shares."""

    model: str
    url: str
    root: str
    prompts: list[str]
    cpu_bytes: int
    ignore: list[str]


def _scenarios(args: argparse.Namespace) -> list[str]:
    return names_option("--scenarios", args.scenarios, list(SCENARIOS))


def _check(args: argparse.Namespace) -> None:
    """Fill the defaults (``--quick``'s where it is given) and check every option before anything starts."""
    fill_defaults(args, FULL, QUICK)
    if args.replicas < 2:
        raise bad_option("--replicas: at least 2 (the router chooses between replicas)")
    if args.capacity_concurrency is None:
        args.capacity_concurrency = 4 * args.replicas
    at_least(1, capacity_concurrency=args.capacity_concurrency, prefixes=args.prefixes, prompts=args.prompts)
    at_least(1, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens)
    at_least(0, max_ongoing_requests=args.max_ongoing_requests)
    at_least(-1, max_queued_requests=args.max_queued_requests)
    above_zero(duration_s=args.duration_s, capacity_s=args.capacity_s, request_timeout_s=args.request_timeout_s)
    for name, value in (("--load", args.load), ("--rate", args.rate)):
        if value is not None and not 0 < value < math.inf:
            raise bad_option(f"{name}: a finite number above 0, got {value}")
    if not 0 <= args.kill_at < 1:
        raise bad_option(f"--kill-at: in [0, 1) (a share of the overload phase), got {args.kill_at}")
    if not 0 <= args.shard_delay_ms < 1e6:
        raise bad_option(f"--shard-delay-ms: in [0, 1000000), got {args.shard_delay_ms}")


def _prompts(model: str, args: argparse.Namespace) -> list[str]:
    from transformers import AutoTokenizer

    from raykv.bench.serve import build_jobs

    jobs = build_jobs(
        AutoTokenizer.from_pretrained(model),
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        prompts=args.prompts,
        sessions=0,
        turns=1,
        tenants=1,
        seed=args.seed,
    )
    return [j.prompts[0] for j in jobs]


def run(args: argparse.Namespace) -> OverloadResult:
    """Run every scenario; returns the JSON result."""
    import ray

    from raykv.bench.serve import _start_serve
    from raykv.bench.serve_app import ENGINE_BLOCKS, start_cluster
    from raykv.demo.replicas import chunk_bytes, deployment_primary_chunks
    from raykv.integrations.vllm import require_vllm

    require_vllm()
    _check(args)
    names = _scenarios(args)
    model, model_name = resolve_model(args)
    info = machine()
    cluster = start_cluster(args.replicas, model)
    per: dict[str, ScenarioResult | Failed] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="overload-bench-") as root:
            cpu_bytes = deployment_primary_chunks(ENGINE_BLOCKS) * chunk_bytes(model)
            setup = Setup(model, _start_serve(), root, _prompts(model, args), cpu_bytes, [model])
            rate: float | None = args.rate
            for name in names:
                _say(args, f"scenario {name}")
                try:
                    done = _run_scenario(name, setup, args, rate)
                except Exception as e:  # noqa: BLE001 - one scenario failing must not lose the others
                    per[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                    continue
                per[name] = done
                rate = rate or done["rate_rps"]  # every scenario gets the first one's offered rate
    finally:
        ray.shutdown()  # and the cluster with Serve in it (serve.shutdown() would print on stdout)
        cluster.shutdown()
    return _result(args, info, model_name, per)


def _result(
    args: argparse.Namespace, info: Report, model_name: str, per: dict[str, ScenarioResult | Failed]
) -> OverloadResult:
    workload: Report = {
        "prefixes": args.prefixes,
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "prompts": args.prompts,
        "output_tokens": args.output_tokens,
        "seed": args.seed,
    }
    return {
        "benchmark": "overload",
        "machine": info,
        "model": model_name,
        "replicas": args.replicas,
        "load": args.load,
        "duration_s": args.duration_s,
        "capacity_s": args.capacity_s,
        "capacity_concurrency": args.capacity_concurrency,
        "rate_rps": args.rate,
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "request_timeout_s": args.request_timeout_s,
        "shard_delay_ms": args.shard_delay_ms,
        "kill_at": args.kill_at,
        "workload": workload,
        "scenarios": per,
        "targets": targets(per),
    }


def _say(args: argparse.Namespace, what: str) -> None:
    if not args.no_progress:
        print(f"[overload] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _sender(url: str, model_id: str, args: argparse.Namespace) -> Send:
    from raykv.bench.serve import stream_completion

    body: dict[str, JsonValue] = {
        "model": model_id,
        "max_tokens": args.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }

    def send(prompt: str) -> float:
        return stream_completion(url, {**body, "prompt": prompt}, timeout_s=args.request_timeout_s)["ttft_ms"]

    return send


def _run_scenario(name: str, setup: Setup, args: argparse.Namespace, rate: float | None) -> ScenarioResult:
    """Start the scenario's raykv and app, measure capacity, then overload it."""
    from ray import serve

    from raykv.bench.serve import _wait_engines, _wait_running, warm_up

    namespace = f"raykv-bench-overload-{name.replace('_', '-')}"
    model_id = f"overload-{name.replace('_', '-')}"
    services = _start_raykv(namespace, args.shard_delay_ms if name == "slow_shard" else 0.0)
    try:
        serve.run(_app(setup, args, namespace, model_id), name=APP_NAME, route_prefix="/", blocking=False)
        _wait_running(APP_NAME, setup.url)
        _wait_engines(services, args.replicas)
        warm_up(setup.url, model_id, args.replicas)
        send = _sender(setup.url, model_id, args)
        _say(args, f"{name}: capacity, {args.capacity_concurrency} clients for {args.capacity_s:.0f} s")
        capacity = closed_loop(setup.prompts, send, args.capacity_concurrency, args.capacity_s, args.seed)
        if capacity <= 0:
            raise RuntimeError(f"no request completed in the {args.capacity_s:.0f} s capacity phase")
        rate = rate or args.load * capacity
        _say(args, f"{name}: capacity {capacity:.2f} req/s; {rate:.2f} req/s for {args.duration_s:.0f} s")
        return _overload(name, setup, args, namespace, send, capacity, rate)
    finally:
        # delete the app, not Serve: killing Serve's controller prints Ray's warnings on stdout
        serve.delete(APP_NAME)
        _shutdown(services)


def _overload(
    name: str, setup: Setup, args: argparse.Namespace, namespace: str, send: Send, capacity: float, rate: float
) -> ScenarioResult:
    """The open-loop phase, with the dead shard's kill on a timer; its summary and raykv's figures."""
    time.sleep(METRICS_SETTLE_S)  # not a wait on a condition: Ray exports metrics every few seconds
    before = read_metrics()
    schedule = poisson_schedule(rate, args.duration_s, args.seed)
    killed: list[float] = []
    timer = None
    if name == "dead_shard":
        start = time.perf_counter()
        timer = threading.Timer(args.kill_at * args.duration_s, _kill_shard, (namespace, killed, start))
        timer.start()
    outcomes, t0 = open_loop(
        schedule, setup.prompts, send, drain_s=args.request_timeout_s + 10, ignore=setup.ignore, seed=args.seed
    )
    if timer is not None:
        timer.cancel()
    time.sleep(METRICS_SETTLE_S)  # not a wait on a condition: the phase's last metrics exported
    out = scenario_summary(outcomes, capacity, rate, args.duration_s)
    out["raykv"] = figures(before, read_metrics())
    out["fault_at_s"] = killed[0] if killed else None
    return out


def _kill_shard(namespace: str, killed: list[float], start: float) -> None:
    import ray

    from raykv.core import naming

    ray.kill(ray.get_actor(naming.directory_shard(FAULT_SHARD), namespace=namespace), no_restart=True)
    killed.append(time.perf_counter() - start)


def _start_raykv(namespace: str, delay_ms: float) -> RaykvServices:
    """raykv's services in ``namespace``; with ``delay_ms``, shard ``FAULT_SHARD`` is created first
    with the fault injection in its environment (``raykv.start`` then finds it by name)."""
    import ray

    import raykv

    if delay_ms > 0:
        from raykv.core import naming
        from raykv.directory.shard import TESTING_DELAY_ENV, DirectoryShard

        env = {TESTING_DELAY_ENV: f"{FAULT_SHARD}:{delay_ms:.0f}"}
        shard = DirectoryShard.options(  # type: ignore[attr-defined]  # a Ray actor class
            name=naming.directory_shard(FAULT_SHARD),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            runtime_env={"env_vars": env},
        ).remote(FAULT_SHARD, DIRECTORY_SHARDS, namespace)
        ray.get(shard.ping.remote())
    return raykv.start({"namespace": namespace, "directory_shards": DIRECTORY_SHARDS})


def _shutdown(services: RaykvServices) -> None:
    try:
        services.shutdown()
    except Exception:  # noqa: BLE001 - a killed shard may fail its own shutdown; the cluster goes next
        pass


def _app(setup: Setup, args: argparse.Namespace, namespace: str, model_id: str) -> Application:
    """The ``raykv`` configuration of ``raykv bench serve`` with Serve's queues bounded."""
    from raykv.bench.serve_app import bench_app

    # merged into the deployment config llm_config makes for router="raykv" (its router stays)
    deployment: dict[str, JsonValue] = {"num_replicas": args.replicas, "max_queued_requests": args.max_queued_requests}
    if args.max_ongoing_requests > 0:
        deployment["max_ongoing_requests"] = args.max_ongoing_requests
    raykv_cfg: dict[str, JsonValue] = {
        "namespace": namespace,
        "tiers": [{"type": "object_store"}, {"type": "fs", "root": f"{setup.root}/{namespace}"}],
    }
    return bench_app(
        setup.model,
        model_id=model_id,
        replicas=args.replicas,
        router="raykv",
        raykv=raykv_cfg,
        cpu_bytes=setup.cpu_bytes,
        experimental_configs={"stream_batching_interval_ms": 0},
        deployment_config=deployment,
    )


# ---------------------------------------------------------------- report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _le(x: float | None) -> str:
    return "-" if x is None else "inf" if x == math.inf else f"<= {x * 1000:g} ms"


def format_result(result: OverloadResult) -> str:
    head = (
        f"raykv bench overload: {result['replicas']} replicas (one per simulated node), model {result['model']}, "
        f"raykv router + tiers; open-loop Poisson arrivals at {result['load']:g}x the measured capacity for "
        f"{result['duration_s']:.0f} s; Serve max_ongoing_requests {result['max_ongoing_requests']} per replica, "
        f"max_queued_requests {result['max_queued_requests']}; request timeout {result['request_timeout_s']:.0f} s"
    )
    parts = [head, summary_table(result)]
    for name, s in result["scenarios"].items():
        if "error" not in s:
            parts.append(seconds_table(name, s))
    parts.append(targets_table(result["targets"]))
    return "\n\n".join(parts)


def summary_table(result: OverloadResult) -> str:
    rows: list[list[object]] = []
    for name, s in result["scenarios"].items():
        if "error" in s:
            rows.append([name, "failed: " + s["error"][:70], *[""] * 13])
            continue
        e, r = s["errors"], s["raykv"]
        rows.append(
            [
                name,
                f"{s['capacity_rps']:.2f}",
                f"{s['rate_rps']:.2f}",
                s["sent"],
                f"{s['completed_per_s']:.2f}",
                *(e[c] for c in CAUSES),
                _ms(s["ttft_p50_ms"]),
                _ms(s["ttft_p99_ms"]),
                _le(r["router_decision_max_le_s"]),
                _le(r["engine_step_max_le_s"]),
                "-" if r["router_fallbacks"] is None else r["router_fallbacks"],
                "-" if r["retry_budget_misses"] is None else r["retry_budget_misses"],
            ]
        )
    headers = ["scenario", "capacity req/s", "offered req/s", "sent", "done req/s"]
    headers += [f"err {c}" for c in CAUSES]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "router decision max", "engine step max", "router fallbacks"]
    headers += ["MISS by budget"]
    return table(headers, rows)


def seconds_table(name: str, s: ScenarioResult) -> str:
    """The per-second rows of one scenario."""
    rows = [
        [
            sec["t"],
            sec["completed"],
            *(sec["errors"][c] for c in CAUSES),
            _ms(sec["ttft_p50_ms"]),
            _ms(sec["ttft_p99_ms"]),
        ]
        for sec in s["per_second"]
    ]
    title = f"{name}, per second (by when requests ended)"
    if s["fault_at_s"] is not None:
        title += f"; shard {FAULT_SHARD} killed at {s['fault_at_s']:.1f} s"
    return table(["s", "done", *CAUSES, "TTFT p50", "TTFT p99"], rows, title=title)
