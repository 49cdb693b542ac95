"""A vLLM engine replica as a Ray actor, pinned to a node (demo, tests, benchmarks).

The engine runs inside the actor process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so its scheduler, and the raykv tiers in it, are a Ray worker of the actor's
node: the object store tier talks to that node's actor. Ray Serve LLM replicas
run the same way.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.validate import ArgumentError

#: Environment every replica gets: the engine in-process, a small CPU KV cache.
REPLICA_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass
class Completion:
    """What one request gave: cache hits, time to first token, output."""

    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    token_ids: list[int]
    top_logprobs: list[tuple[int, float]]  # first output token's top-k

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EngineReplica:
    """One ``vllm.LLM`` with a given ``kv_transfer_config``."""

    def __init__(self, model: str, kv_transfer_config: dict[str, Any] | None, engine_kwargs: dict[str, Any]) -> None:
        self.model = model
        if not isinstance(model, str) or not model:
            raise ArgumentError("model", f"must be a model name or path (str), got {model!r}")
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(model=model, kv_transfer_config=kv_transfer_config, **engine_kwargs)
        self.load_s = time.perf_counter() - t0

    def __repr__(self) -> str:
        # What it serves only (the dashboard records it once); works when __init__ raised early.
        return f"EngineReplica(model={self.__dict__.get('model', '?')!r})"

    def ready(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "load_s": self.load_s, "pid": os.getpid()}

    def generate(
        self, prompt_token_ids: list[int], max_tokens: int = 1, kv_transfer_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Greedy generation of one prompt. With ``max_tokens=1`` the wall time is the TTFT."""
        from vllm import SamplingParams

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, extra_args=extra)
        t0 = time.perf_counter()
        (out,) = self.llm.generate([{"prompt_token_ids": prompt_token_ids}], params, use_tqdm=False)
        ms = (time.perf_counter() - t0) * 1000
        self.settle()
        first = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
        return Completion(
            prompt_tokens=len(prompt_token_ids),
            cached_tokens=int(out.num_cached_tokens or 0),
            ttft_ms=ms,
            token_ids=list(out.outputs[0].token_ids),
            top_logprobs=[(int(t), float(lp.logprob)) for t, lp in first.items()],
        ).to_dict()

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Step the engine until its offloads are done; True when settled.

        ``LLM.generate`` returns when its requests finish, but the engine
        cascades their blocks to the secondary tiers in later steps. Run
        in-process, nothing else steps it: the replica does, between requests.
        """
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        if core is None:  # engine in its own process: its busy loop steps it
            return True
        deadline = time.monotonic() + timeout_s
        while core.scheduler.has_requests():
            if time.monotonic() > deadline:
                return False
            core.step_fn()
            time.sleep(0.002)
        return True

    def hits_by_source(self) -> dict[str, float]:
        """vLLM's prefix-cache hit counters (tokens) per source."""
        return {
            m.labels["source"]: m.value
            for m in self.llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source"
        }

    def raykv_lookups(self) -> dict[str, float]:
        """raykv tier lookups answered HIT / MISS / RETRY so far (``vllm:raykv_lookup_*``, all tiers)."""
        out = {"hits": 0.0, "misses": 0.0, "retries": 0.0}
        for m in self.llm.get_metrics():
            if m.name.startswith("vllm:raykv_lookup_") and hasattr(m, "value"):
                out[m.name.removeprefix("vllm:raykv_lookup_")] = (
                    out.get(m.name.removeprefix("vllm:raykv_lookup_"), 0.0) + m.value
                )
        rtt = self._lookup_rtt_s()
        if rtt is not None:
            out["rtt_ms"] = rtt * 1000
        return out

    def cascade_drops(self) -> int:
        """Blocks this engine computed that never reached its CPU primary (it was full), so
        no raykv tier got them (``vllm:raykv_cascade_dropped_blocks``; ``raykv.integrations.vllm.drops``)."""
        return int(sum(m.value for m in self.llm.get_metrics() if m.name == "vllm:raykv_cascade_dropped_blocks"))

    def _lookup_rtt_s(self) -> float | None:
        """The smoothed directory round trip this process's engine measured (in-process engine only)."""
        from raykv.cluster import attached_services

        rtts = [s.lookup_cache.rtt_s for s in attached_services() if s.lookup_cache.rtt_s is not None]
        return sum(rtts) / len(rtts) if rtts else None

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def start_replica(
    node_id: str,
    model: str,
    kv_transfer_config: dict[str, Any] | None,
    engine_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> Any:
    """Start an ``EngineReplica`` actor on ``node_id``; returns its handle (not yet ready)."""
    env_vars = {**REPLICA_ENV, **(env or {})}
    for var in ("PYTHONPATH", "HF_HUB_OFFLINE"):
        if var in os.environ:
            env_vars.setdefault(var, os.environ[var])
    actor = ray.remote(num_cpus=0)(EngineReplica)
    return actor.options(
        name=name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": env_vars},
    ).remote(model, kv_transfer_config, dict(engine_kwargs or {}))


BLOCK_TOKENS = 128  # vLLM's CPU backend block size


def engine_kwargs(max_model_len: int, engine_blocks: int) -> dict[str, Any]:
    """Engine arguments of a small-cache replica (``engine_blocks`` blocks of KV)."""
    return {
        "max_model_len": max_model_len,
        "num_gpu_blocks_override": engine_blocks,
        "enforce_eager": True,
        "disable_log_stats": False,
    }


def chunk_bytes(model: str, block_tokens: int = BLOCK_TOKENS, dtype_bytes: int = 2) -> int:
    """Bytes of one KV block of ``model`` (K and V, all layers): sizes CPU primaries."""
    with open(f"{model}/config.json") as f:
        cfg = json.load(f)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * block_tokens * dtype_bytes


def start_local_cluster(num_nodes: int, object_store_mib: int = 384) -> tuple[Any, list[str]]:
    """An embedded Ray of ``num_nodes`` simulated nodes; returns it and its node ids (head first)."""
    from ray.cluster_utils import Cluster

    mib = 1024 * 1024
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": object_store_mib * mib, "include_dashboard": False},
    )
    for _ in range(num_nodes - 1):
        cluster.add_node(num_cpus=1, object_store_memory=object_store_mib * mib)
    ray.init(address=cluster.address, log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != head)
    return cluster, nodes


def run_trace(
    name: str,
    nodes: list[str],
    model: str,
    kv_config: dict[str, Any] | None,
    trace: Sequence[Any],
    engine_kw: dict[str, Any],
    progress: Any,
    after: Callable[[list[Any]], Any] | None = None,
    before: Callable[[], Any] | None = None,
) -> tuple[list[dict[str, Any]], Any]:
    """Start one replica per node, call ``before()``, send ``trace`` (requests with
    ``replica`` and ``prompt_token_ids``) one at a time, then ``after(replicas)``, and
    stop the replicas. Returns one result per request, and what ``after`` returned."""
    from raykv.demo.tiny_model import make_prompt_tokens

    progress.set_description(f"{name}: starting {len(nodes)} vLLM replicas")
    replicas = [start_replica(node, model, kv_config, engine_kw) for node in nodes]
    try:
        ray.get([r.ready.remote() for r in replicas], timeout=600)
        # The first request of an engine pays one-off kernel set-up: not timed.
        ray.get([r.generate.remote(make_prompt_tokens(200, 999 + i)) for i, r in enumerate(replicas)], timeout=600)
        progress.set_description(f"{name}: {len(trace)} requests")
        if before is not None:
            before()
        results = []
        for req in trace:
            results.append(ray.get(replicas[req.replica].generate.remote(req.prompt_token_ids), timeout=600))
            progress.update(1)
        return results, (after(replicas) if after is not None else None)
    finally:
        for r in replicas:
            try:
                ray.get(r.shutdown.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(r)
