"""``raykv demo``: real vLLM replicas on an embedded local Ray, with and without raykv.

A local Ray of ``replicas`` simulated nodes (``ray.cluster_utils.Cluster``)
runs one vLLM engine replica per node, as a Ray actor, each with a small
engine KV cache. A multi-turn, shared-prefix workload goes round-robin over
the replicas twice:

- *baseline*: vLLM with per-replica CPU offload only (what each replica
  remembers by itself);
- *raykv*: the same engines with raykv's cluster cache as secondary tiers
  (each node's object store, then a shared fs root), so a replica promotes
  blocks that another replica computed.

It prints prefix tokens hit, TTFT p50/p90 and whether every output (first
token and its top-5 logprobs) was identical; ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

import numpy as np

from raykv.demo.replicas import BLOCK_TOKENS, chunk_bytes, engine_kwargs, run_trace, start_local_cluster
from raykv.demo.workload import build_trace, model_len_for, oracle_hit_tokens

NAMESPACE = "raykv-demo"
ENGINE_BLOCKS = 16  # a small engine cache: 2048 tokens, about one session
PRIMARY_CHUNKS = 96  # per-replica CPU offload: holds what the replica computed


def _summary(results: list[dict[str, Any]]) -> dict[str, float]:
    ttft = np.array([r["ttft_ms"] for r in results])
    return {
        "hit_tokens": int(sum(r["cached_tokens"] for r in results)),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
        "ttft_p90_ms": round(float(np.percentile(ttft, 90)), 1),
    }


def _outputs_match(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return all(x["token_ids"] == y["token_ids"] and x["top_logprobs"] == y["top_logprobs"] for x, y in zip(a, b))


def demo(
    replicas: int = 2, sessions: int = 5, turns: int = 4, model: str | None = None, show_progress: bool = True
) -> dict[str, Any]:
    """Run both phases; returns the report (what ``--json`` prints)."""
    import ray
    from tqdm import tqdm

    import raykv
    from raykv.demo.tiny_model import MODEL_NAME, build_tiny_model
    from raykv.integrations.vllm import kv_transfer_config, raykv_kv_transfer_config, require_vllm

    require_vllm()
    t0 = time.perf_counter()
    model_path = model or build_tiny_model()
    trace = build_trace(sessions=sessions, turns=turns, replicas=replicas)
    max_len = model_len_for(trace, BLOCK_TOKENS)
    chunk = chunk_bytes(model_path)
    cluster, nodes = start_local_cluster(replicas)
    progress = tqdm(total=2 * len(trace), disable=not show_progress, file=sys.stderr, unit="req")
    try:
        with tempfile.TemporaryDirectory(prefix="raykv-demo-fs-") as fs_root:
            baseline, _ = run_trace(
                "baseline",
                nodes,
                model_path,
                kv_transfer_config([], cpu_bytes=PRIMARY_CHUNKS * chunk),
                trace,
                engine_kwargs(max_len, ENGINE_BLOCKS),
                progress,
            )
            config = {
                "namespace": NAMESPACE,
                "tiers": [
                    {"type": "object_store", "capacity_bytes": 256 << 20},
                    {"type": "fs", "root": fs_root, "capacity_bytes": 1 << 30},
                ],
            }
            services = raykv.start(config)
            with_raykv, _ = run_trace(
                "raykv",
                nodes,
                model_path,
                raykv_kv_transfer_config(config, cpu_bytes=PRIMARY_CHUNKS * chunk),
                trace,
                engine_kwargs(max_len, ENGINE_BLOCKS),
                progress,
            )
            from raykv.status import collect_status

            status = collect_status(services)
            services.shutdown()
    finally:
        progress.close()
        ray.shutdown()
        cluster.shutdown()
    base, rk = _summary(baseline), _summary(with_raykv)
    return {
        "replicas": replicas,
        "requests": len(trace),
        "sessions": sessions,
        "turns": turns,
        "model": MODEL_NAME if model is None else model,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in trace),
        "oracle_hit_tokens": oracle_hit_tokens(trace, BLOCK_TOKENS),
        "baseline_hit_tokens": base["hit_tokens"],
        "raykv_hit_tokens": rk["hit_tokens"],
        "baseline_ttft_p50_ms": base["ttft_p50_ms"],
        "raykv_ttft_p50_ms": rk["ttft_p50_ms"],
        "baseline_ttft_p90_ms": base["ttft_p90_ms"],
        "raykv_ttft_p90_ms": rk["ttft_p90_ms"],
        "outputs_match": _outputs_match(baseline, with_raykv),
        "directory_keys": status["directory"]["keys"],
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }


def format_report(r: dict[str, Any]) -> str:
    rows = [
        ("prefix tokens hit", f"{r['baseline_hit_tokens']}", f"{r['raykv_hit_tokens']}"),
        (
            "  share of prompt tokens",
            f"{r['baseline_hit_tokens'] / r['prompt_tokens']:.0%}",
            f"{r['raykv_hit_tokens'] / r['prompt_tokens']:.0%}",
        ),
        ("TTFT p50 (ms)", f"{r['baseline_ttft_p50_ms']:.0f}", f"{r['raykv_ttft_p50_ms']:.0f}"),
        ("TTFT p90 (ms)", f"{r['baseline_ttft_p90_ms']:.0f}", f"{r['raykv_ttft_p90_ms']:.0f}"),
    ]
    head = (
        f"raykv demo: {r['replicas']} vLLM replicas on {r['replicas']} simulated nodes, {r['requests']} requests "
        f"({r['sessions']} sessions x {r['turns']} turns, round-robin), model {r['model']}"
    )
    lines = [head, "", f"{'':26}{'per-replica CPU offload':>26}{'raykv cluster cache':>22}"]
    lines += [f"{a:26}{b:>26}{c:>22}" for a, b, c in rows]
    lines += [
        "",
        f"one unbounded cluster-wide cache would hit {r['oracle_hit_tokens']} tokens; "
        f"the directory holds {r['directory_keys']} keys",
        f"outputs identical (first token and top-5 logprobs, every request): {'yes' if r['outputs_match'] else 'NO'}",
        f"finished in {r['elapsed_s']:.0f} s",
    ]
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    report = demo(
        replicas=args.replicas, sessions=args.sessions, turns=args.turns, model=args.model, show_progress=True
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["outputs_match"] else 1
