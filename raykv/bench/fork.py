"""``raykv bench fork``: a burst of requests sharing a new long prefix, all sent at once.

The shape of agentic traffic (an orchestrator forking subagents off one shared
context, questions about a document just uploaded): ``--forks`` requests,
each the same new ``--prefix-tokens`` prefix plus a short suffix of its own,
sent at the same moment to a Ray Serve LLM app of ``--replicas`` vLLM
replicas (one per simulated node of an embedded ``Cluster``; the local bench
model, whose prefill costs what a real model's does per byte of KV) with
raykv's tiers (each node's object store, a shared fs root). Three
configurations, each from empty caches, in the same run:

- ``today``: Serve's default router, raykv without pending entries: every
  replica that gets a fork before the prefix is stored computes it;
- ``pending``: the same with pending entries (``pending_entries``): a replica
  whose request meets the prefix being computed elsewhere waits for that copy;
- ``router``: raykv's router as well, which sends the burst where the prefix
  is being computed while that replica has room.

Per configuration, over ``--bursts`` bursts (a new prefix each): the shared
prefix's tokens computed cluster-wide as a multiple of one prefix (the floor
is 1.0; from each request's ``cached_tokens``: a prefix token not cached was
computed), TTFT p50/p90 (a one-token completion's latency) and requests
finished per second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import TYPE_CHECKING, TypedDict, final

from raykv.bench.common import (
    Failed,
    all_at_once,
    bad_option,
    fill_defaults,
    machine,
    names_option,
    percentile,
    read_settled,
    table,
    target,
    targets_table,
)
from raykv.bench.routing import (
    BLOCK,
    METRICS_SETTLE_S,
    MODEL_ID,
    Usage,
    complete,
    full_block_tokens,
)
from raykv.config.options import RaykvConfig
from raykv.core.wire import Report
from raykv.demo.models import model_positions, resolve_model
from raykv.demo.replicas import check_replicas_fit

if TYPE_CHECKING:
    from raykv.demo.replicas import Progress

HELP = "a burst of requests sharing a new long prefix: computed once or per replica? (3 configurations)"

CONFIGS = ("today", "pending", "router")
#: Engine cache per replica, in blocks of ``BLOCK`` tokens: a burst's prefix and every fork's suffix
#: fit (at least; twice a longer prompt's blocks, ``engine_blocks``).
ENGINE_BLOCKS = 64
#: A burst's requests that do not answer in this time count as failed.
REQUEST_TIMEOUT_S = 120
#: Pause between bursts, so that one burst's stores do not overlap the next one.
SETTLE_S = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, help="vLLM replicas, one per simulated node (default 3; quick 2)")
    p.add_argument("--forks", type=int, help="requests per burst, all sent at once (default 8; quick 3)")
    p.add_argument("--prefix-tokens", type=int, help="the shared new prefix (default 2048; quick 512)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="each fork's own suffix (default 32)")
    p.add_argument("--bursts", type=int, help="bursts per configuration, a new prefix each (default 3; quick 1)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument(
        "--model",
        help="'bench' (default: the local bench model, 4096 positions), 'bench-long' (the same, 32768 "
        "positions: a prefix past 4k tokens), 'tiny', or a model directory",
    )
    p.add_argument(
        "--pending-max-wait-ms",
        type=float,
        help="raykv's pending_max_wait_ms for the configurations with pending entries (default: raykv's)",
    )
    p.add_argument("--tiny", action="store_true", help="the tiny local model (same as --model tiny)")


class RequestRecord(TypedDict):
    """One answered request of a burst."""

    burst: int
    prompt_tokens: int
    cached_tokens: int
    prefix_computed_tokens: int  # of the burst's shared (cacheable) prefix
    ttft_ms: float


@final  # so that ``"error" in r`` tells a failure (``Failed``) from a summary
class ConfigSummary(TypedDict):
    """One configuration's figures over its bursts."""

    prefix_multiple: float  # mean over bursts of the prefix tokens computed / one prefix
    prefix_multiples: list[float]  # per burst
    ttft_p50_ms: float
    ttft_p90_ms: float
    requests_per_s: float
    cached_tokens: int
    prompt_tokens: int
    requests: list[RequestRecord]
    #: the engines' compute-once decisions over the run (``raykv_pending_decisions``), and
    #: ``idle_ms``: their schedulers' pauses in steps that ran nothing (``raykv_engine_idle_seconds``)
    decisions: dict[str, int]


class ForkResult(TypedDict):
    """The JSON result of ``raykv bench fork``."""

    benchmark: str
    machine: Report
    replicas: int
    forks: int
    prefix_tokens: int
    cacheable_prefix_tokens: int
    suffix_tokens: int
    bursts: int
    model: str
    pending_max_wait_ms: float  # what the pending configurations ran with
    configs: dict[str, ConfigSummary | Failed]
    targets: list[Report]


def run(args: argparse.Namespace) -> ForkResult:
    """Run the bursts under each configuration; returns the JSON result."""
    import ray
    from tqdm import tqdm

    from raykv.bench.serve_app import start_cluster
    from raykv.integrations.vllm import require_vllm

    fill_defaults(
        args,
        {"replicas": 3, "forks": 8, "bursts": 3, "prefix_tokens": 2048},
        {"replicas": 2, "forks": 3, "bursts": 1, "prefix_tokens": 512},
    )
    if args.replicas < 2:
        raise bad_option("--replicas: at least 2 (a burst meets a prefix computed on another replica)")
    if args.forks < 2 or args.bursts < 1:
        raise bad_option("--forks: at least 2; --bursts: at least 1")
    if args.prefix_tokens < BLOCK or args.suffix_tokens < 1:
        raise bad_option(f"--prefix-tokens: at least {BLOCK} (one block); --suffix-tokens: at least 1")
    positions = args.max_model_len = model_positions(args)
    if args.prefix_tokens + args.suffix_tokens >= positions:
        raise bad_option(
            f"--prefix-tokens + --suffix-tokens: under {positions} (the model's max_model_len; "
            "--model bench-long: 32768)"
        )
    wait = {} if args.pending_max_wait_ms is None else {"pending_max_wait_ms": args.pending_max_wait_ms}
    try:  # raykv's own default and bounds for the option
        args.pending_max_wait_ms = RaykvConfig.from_dict(wait).pending_max_wait_ms
    except ValueError as e:
        raise bad_option(f"--pending-max-wait-ms: {e}") from None
    configs = names_option("--configs", args.configs, CONFIGS)
    model, model_name = resolve_model(args)
    check_replicas_fit(args.replicas, model)  # bad input fails before vLLM's seconds of import
    require_vllm()
    info = machine()
    cluster = start_cluster(args.replicas, model)
    progress = tqdm(
        total=len(configs) * args.bursts * args.forks, file=sys.stderr, disable=args.no_progress, unit="req"
    )
    per: dict[str, ConfigSummary | Failed] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="raykv-bench-fork-") as root:
            for name in configs:
                try:
                    per[name] = _run_config(name, model, f"{root}/{name}", args, progress)
                except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
                    per[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        progress.close()
        ray.shutdown()
        cluster.shutdown()
    return {
        "benchmark": "fork",
        "machine": info,
        "replicas": args.replicas,
        "forks": args.forks,
        "prefix_tokens": args.prefix_tokens,
        "cacheable_prefix_tokens": full_block_tokens(args.prefix_tokens),
        "suffix_tokens": args.suffix_tokens,
        "bursts": args.bursts,
        "model": model_name,
        "pending_max_wait_ms": args.pending_max_wait_ms,
        "configs": per,
        "targets": _targets(per),
    }


def _run_config(name: str, model: str, root: str, args: argparse.Namespace, progress: Progress) -> ConfigSummary:
    from ray import serve

    import raykv
    from raykv.bench.routing import EngineWatch
    from raykv.bench.serve_app import bench_app
    from raykv.demo.replicas import chunk_bytes, deployment_primary_chunks

    namespace = f"raykv-bench-fork-{name}"
    options = {"namespace": namespace, "directory_shards": 2, "pending_entries": name != "today"}
    if name != "today":
        options["pending_max_wait_ms"] = args.pending_max_wait_ms
    services = raykv.start(options)
    blocks = engine_blocks(args)
    app = bench_app(
        model,
        model_id=MODEL_ID,
        replicas=args.replicas,
        router="raykv" if name == "router" else "default",
        raykv={"namespace": namespace, "tiers": [{"type": "object_store"}, {"type": "fs", "root": root}]},
        cpu_bytes=deployment_primary_chunks(blocks) * chunk_bytes(model),
        engine_cache=True,
        # (half the cache: vLLM wants a block or two more than the longest prompt)
        engine_kwargs={
            "max_model_len": min(args.max_model_len, blocks * BLOCK // 2),
            "num_gpu_blocks_override": blocks,
        },
    )
    try:
        serve.run(app, name="raykv-bench-fork", route_prefix="/", blocking=False)
        EngineWatch(services, model).wait_engines(args.replicas)
        _warm_up(args.replicas)
        records: list[RequestRecord] = []
        busy_s = 0.0
        for burst in range(args.bursts):
            t0 = time.perf_counter()
            records += _burst(burst, args, progress)
            busy_s += time.perf_counter() - t0
            time.sleep(SETTLE_S)
        summary = _summary(records, args, busy_s)
        summary["decisions"] = _decisions()
        return summary
    finally:
        serve.delete("raykv-bench-fork")
        services.shutdown()


def engine_blocks(args: argparse.Namespace) -> int:
    """Each replica's engine cache in blocks: ``ENGINE_BLOCKS``, or twice a fork's prompt."""
    return max(ENGINE_BLOCKS, 2 * -(-(args.prefix_tokens + args.suffix_tokens + 1) // BLOCK))


def _all_at_once(prompts: list[list[int]]) -> list[tuple[Usage, float] | BaseException]:
    """Send every prompt at the same moment; per prompt, its usage and TTFT, or its error."""
    return all_at_once(lambda prompt: complete(prompt, timeout_s=REQUEST_TIMEOUT_S), prompts)


def _warm_up(replicas: int) -> None:
    """Every replica computes and stores prompts of its own first (kernels set up, and an
    engine in service has measured its compute time), then the stores settle."""
    from raykv.demo.tiny_model import make_prompt_tokens

    prompts = [make_prompt_tokens(4 * BLOCK + 7, 90_000 + i) for i in range(3 * replicas)]
    for _ in range(2):  # twice: a request whose first answers came late learns nothing
        failed = [r for r in _all_at_once(prompts) if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"the app failed warm-up requests: {failed[0]!r}")
        prompts = [make_prompt_tokens(4 * BLOCK + 7, 91_000 + i) for i in range(3 * replicas)]
    time.sleep(SETTLE_S)


def _burst(burst: int, args: argparse.Namespace, progress: Progress) -> list[RequestRecord]:
    """One burst: ``--forks`` prompts sharing a new prefix, sent at once."""
    from raykv.demo.tiny_model import make_prompt_tokens

    prefix = make_prompt_tokens(args.prefix_tokens, 10_000 + burst)
    prompts = [prefix + make_prompt_tokens(args.suffix_tokens, 20_000 + 100 * burst + f) for f in range(args.forks)]
    cacheable = full_block_tokens(args.prefix_tokens)
    records: list[RequestRecord] = []
    for result in _all_at_once(prompts):
        progress.update(1)
        if isinstance(result, BaseException):
            raise RuntimeError(f"burst {burst}: a request failed: {result!r}")
        usage, seconds = result
        records.append(
            {
                "burst": burst,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "prefix_computed_tokens": max(0, cacheable - usage.cached_tokens),
                "ttft_ms": seconds * 1000,
            }
        )
    return records


def _decisions(timeout_s: float = 40.0) -> dict[str, int]:
    """The replicas' compute-once decisions (``raykv_pending_decisions``, summed over
    the cluster), once two reads ``METRICS_SETTLE_S`` apart agree (Ray exports every few seconds)."""
    from raykv.metrics.scrape import scrape_cluster

    def read() -> dict[str, int]:
        out: dict[str, int] = {}
        for n, labels, v in scrape_cluster():
            if n == "ray_raykv_pending_decisions_total":
                decision = labels.get("decision", "?")
                out[decision] = out.get(decision, 0) + int(v)
            elif n == "ray_raykv_engine_idle_seconds_total":  # waiting engines' paused steps
                out["idle_ms"] = out.get("idle_ms", 0) + int(v * 1000)
        return out

    return read_settled(read, METRICS_SETTLE_S, timeout_s)


def _summary(records: list[RequestRecord], args: argparse.Namespace, busy_s: float) -> ConfigSummary:
    cacheable = full_block_tokens(args.prefix_tokens)
    multiples = [
        sum(r["prefix_computed_tokens"] for r in records if r["burst"] == b) / cacheable for b in range(args.bursts)
    ]
    ttft = [r["ttft_ms"] for r in records]
    return {
        "prefix_multiple": sum(multiples) / len(multiples),
        "prefix_multiples": multiples,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "requests_per_s": len(records) / busy_s if busy_s else float("nan"),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "requests": records,
        "decisions": {},
    }


def _targets(per: dict[str, ConfigSummary | Failed]) -> list[Report]:
    ok = {name: r for name, r in per.items() if "error" not in r}
    today = ok.get("today")
    out = []
    for name in ("pending", "router"):
        r = ok.get(name)
        if r is None:
            continue
        worst = max(r["prefix_multiples"])
        out.append(
            target(
                f"prefix computed cluster-wide, worst burst, {name} (x one prefix)",
                worst,
                1.3,
                higher_is_better=False,
                detail="per burst " + ", ".join(f"{m:.2f}" for m in r["prefix_multiples"]),
            )
        )
        if today is not None:
            out.append(
                target(
                    f"TTFT p90, {name} / today",
                    r["ttft_p90_ms"] / today["ttft_p90_ms"],
                    0.8,
                    higher_is_better=False,
                    detail=f"{r['ttft_p90_ms']:.0f} vs {today['ttft_p90_ms']:.0f} ms",
                )
            )
    return out


def format_result(result: ForkResult) -> str:
    rows: list[list[object]] = []
    for name, r in result["configs"].items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"][:70], "", "", "", ""])
            continue
        rows.append(
            [
                name,
                f"{r['prefix_multiple']:.2f}",
                " ".join(f"{m:.2f}" for m in r["prefix_multiples"]),
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p90_ms']:.0f}",
                f"{r['requests_per_s']:.2f}",
            ]
        )
    head = (
        f"raykv bench fork: {result['forks']} requests at once sharing a new {result['prefix_tokens']}-token prefix "
        f"({result['cacheable_prefix_tokens']} in full blocks) + {result['suffix_tokens']} tokens of their own, "
        f"{result['replicas']} replicas, {result['bursts']} bursts per configuration; model {result['model']}; "
        f"pending_max_wait_ms {result.get('pending_max_wait_ms', 'default')}"
    )
    body = table(
        ["config", "prefix computed (x one)", "per burst", "TTFT p50 ms", "TTFT p90 ms", "req/s"],
        rows,
    )
    legend = (
        "today: Serve's default router, raykv without pending entries; pending: with pending entries; "
        "router: raykv's router and pending entries. prefix computed: the shared prefix's tokens that "
        "no request found cached (vLLM's cached_tokens), over one prefix: 1.0 is computing it once."
    )
    decided = [
        f"{name}: " + ", ".join(f"{d} {n}" for d, n in sorted(r.get("decisions", {}).items()))
        for name, r in result["configs"].items()
        if "error" not in r and r.get("decisions")
    ]
    decisions = "compute-once decisions (raykv_pending_decisions): " + "; ".join(decided) if decided else ""
    return "\n\n".join(filter(None, [head, body, legend, decisions, targets_table(result["targets"])]))
