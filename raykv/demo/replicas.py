"""A vLLM engine replica as a Ray actor, pinned to a node (demo, tests, benchmarks).

The engine runs inside the actor process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so its scheduler, and the raykv tiers in it, are a Ray worker of the actor's
node: the object store tier talks to that node's actor. Ray Serve LLM replicas
run the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.core import signals
from raykv.core.logs import LOG_LEVEL_ENV
from raykv.core.validate import ArgumentError
from raykv.core.wire import JsonValue
from raykv.demo.engine_loop import LoopSteps, Pending
from raykv.demo.messages import Completion, ReplicaReady
from raykv.demo.workload import TraceRequest

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

#: A replica's ``kv_transfer_config`` / engine arguments (vLLM's names, JSON values).
EngineConfig = Mapping[str, JsonValue]
T = TypeVar("T")

#: Environment every replica gets: the engine in-process, a small CPU KV cache.
REPLICA_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _top2(position: Mapping[int, Logprob]) -> tuple[float, float]:
    """The two highest logprobs at one output position (-inf for a missing runner-up)."""
    top = sorted((float(lp.logprob) for lp in position.values()), reverse=True) + [float("-inf")]
    return top[0], top[1]


def _value(metric: object) -> float:
    """A counter's or gauge's value (histograms and vectors have none: 0)."""
    value = getattr(metric, "value", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


class Logprob(Protocol):
    """One candidate token's logprob as the engine reports it."""

    logprob: float


class Progress(Protocol):
    """A progress bar (``tqdm``): what ``run_trace`` reports to."""

    def set_description(self, desc: str) -> None: ...

    def update(self, n: int = 1) -> object: ...


class EngineReplica:
    """One in-process vLLM engine with a given ``kv_transfer_config``, stepped by
    its own thread (``EngineLoop``): concurrent calls share engine steps, and
    offloads go on between requests as in a serving engine."""

    def __init__(self, model: str, kv_transfer_config: EngineConfig | None, engine_kwargs: EngineConfig) -> None:
        self.model = model
        if not isinstance(model, str) or not model:
            raise ArgumentError("model", f"must be a model name or path (str), got {model!r}")
        from raykv.demo.engine_loop import EngineLoop

        self.loop = EngineLoop(model, kv_transfer_config, engine_kwargs)
        self.llm = self.loop.llm
        self.load_s = self.loop.load_s
        self._in_flight: dict[int, Pending] = {}  # generate calls waiting for their result, by id

    def __repr__(self) -> str:
        # What it serves only (the dashboard records it once); works when __init__ raised early.
        return f"EngineReplica(model={self.__dict__.get('model', '?')!r})"

    def ready(self) -> ReplicaReady:
        return ReplicaReady(node_id=ray.get_runtime_context().get_node_id(), load_s=self.load_s, pid=os.getpid())

    def raykv_started(self, timeout_s: float = 60.0) -> bool:
        """Wait until the actors raykv started for this engine run (``pending.wait_started``):
        part of a warm-up, as an engine's first request is. True: they run (or there are none)."""
        from raykv.engine.pending import wait_started

        return wait_started(timeout_s)

    def generate(
        self,
        prompt_token_ids: list[int],
        max_tokens: int = 1,
        kv_transfer_params: Mapping[str, JsonValue] | None = None,
        settle: bool = True,
        warm_prefix_tokens: int = 0,
    ) -> Completion:
        """Greedy generation of one prompt.

        ``settle``: return only once the engine's offloads are done too (tests
        that check what reached the tiers); benchmarks pass False, as traffic
        does not wait for offloads. ``warm_prefix_tokens``: first run the
        prompt's first N tokens, untimed, so they sit in the engine's own
        prefix cache (the floor no external cache can beat).
        """
        from raykv.integrations.vllm.engines import greedy_params

        if warm_prefix_tokens > 0:
            warm = greedy_params(1, kv_transfer_params)
            self.loop.submit(prompt_token_ids[:warm_prefix_tokens], warm).result(600)
        params = greedy_params(max_tokens, kv_transfer_params, logprobs=5, ignore_eos=True)
        pending = self.loop.submit(prompt_token_ids, params)
        self._in_flight[id(pending)] = pending
        try:
            out = pending.result(600)
        finally:
            self._in_flight.pop(id(pending), None)
        if settle:
            self.settle()
        first = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
        n_out = len(out.outputs[0].token_ids)
        finished = pending.finished if pending.finished is not None else time.perf_counter()
        first_at = pending.first_token if pending.first_token is not None else finished
        decode = (finished - first_at) * 1000 / (n_out - 1) if n_out > 1 else None
        return Completion(
            prompt_tokens=len(prompt_token_ids),
            cached_tokens=int(out.num_cached_tokens or 0),
            ttft_ms=(first_at - pending.submitted) * 1000,
            token_ids=list(out.outputs[0].token_ids),
            top_logprobs=[(int(t), float(lp.logprob)) for t, lp in first.items()],
            decode_ms_per_token=decode,
            top2=[_top2(pos) for pos in out.outputs[0].logprobs or []],
        )

    def cancel_all(self) -> int:
        """Abort every request in flight, as a server does for clients that hang up:
        their ``generate`` calls raise ``RequestCancelled``. Returns how many."""
        in_flight = list(self._in_flight.values())
        for pending in in_flight:
            self.loop.cancel(pending)
        return len(in_flight)

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Wait until the engine's requests and offloads are done; True when settled.

        A request finishes before the engine has cascaded its blocks to the
        secondary tiers; the engine loop goes on stepping until they are.
        """
        return self.loop.wait_idle(timeout_s)

    def hits_by_source(self) -> dict[str, float]:
        """vLLM's prefix-cache hit counters (tokens) per source."""
        return {
            m.labels["source"]: _value(m)
            for m in self.llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source"
        }

    def raykv_lookups(self) -> dict[str, float]:
        """raykv tier lookups answered HIT / MISS / RETRY so far (``vllm:raykv_lookup_*``, all tiers)."""
        out = {"hits": 0.0, "misses": 0.0, "retries": 0.0}
        for m in self.llm.get_metrics():
            if m.name.startswith("vllm:raykv_lookup_") and hasattr(m, "value"):
                answer = m.name.removeprefix("vllm:raykv_lookup_")
                out[answer] = out.get(answer, 0.0) + _value(m)
        rtt = self._lookup_rtt_s()
        if rtt is not None:
            out["rtt_ms"] = rtt * 1000
        out.update(self._pending_decisions())
        return out

    def raykv_step_cost(self) -> dict[str, float | None]:
        """raykv's cost on this engine's scheduler thread so far: steps, seconds per
        step (mean, p50, p99), polls and lookup waits per step, RETRYs per request
        (``vllm:raykv_engine_*``; ``raykv.integrations.vllm.stats.read_step_cost``)."""
        from raykv.integrations.vllm.stats import read_step_cost

        return read_step_cost(self.llm.get_metrics())

    def loop_steps(self) -> LoopSteps:
        """What the engine loop's thread spent stepping so far (requests / offloads only)."""
        return dataclasses.replace(self.loop.steps)

    def cascade_drops(self) -> int:
        """Blocks this engine computed that never reached its CPU primary (it was full), so
        no raykv tier got them (``vllm:raykv_cascade_dropped_blocks``; ``raykv.integrations.vllm.drops``)."""
        return int(sum(_value(m) for m in self.llm.get_metrics() if m.name == "vllm:raykv_cascade_dropped_blocks"))

    def compute_once(self) -> dict[str, float]:
        """This process's compute-once decisions and idle steps (needs no vLLM stat logging)."""
        return self._pending_decisions()

    def _pending_decisions(self) -> dict[str, float]:
        """This process's compute-once decisions (``pending_<decision>``), and its idle steps
        paused while every request waited (``idle_steps``, ``idle_pause_s``); none when pending
        entries are off."""
        from raykv.engine.pending import decisions_so_far, idle_so_far
        from raykv.services.cluster import attached_services

        out: dict[str, float] = {}
        for services in attached_services():
            decisions = decisions_so_far(services)
            for decision, n in decisions.items():
                out[f"pending_{decision}"] = out.get(f"pending_{decision}", 0.0) + n
            if decisions:
                steps, slept_s = idle_so_far(services)
                out["idle_steps"] = out.get("idle_steps", 0.0) + steps
                out["idle_pause_s"] = out.get("idle_pause_s", 0.0) + slept_s
        return out

    def _lookup_rtt_s(self) -> float | None:
        """The smoothed directory round trip this process's engine measured (in-process engine only)."""
        from raykv.services.cluster import attached_services

        rtts = [r for s in attached_services() if (r := s.lookup_cache.round_trips.rtt_s) is not None]
        return sum(rtts) / len(rtts) if rtts else None

    def shutdown(self) -> None:
        self.loop.shutdown()


def start_replica(
    node_id: str,
    model: str,
    kv_transfer_config: EngineConfig | None,
    engine_kwargs: EngineConfig | None = None,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> ActorHandle:
    """Start an ``EngineReplica`` actor on ``node_id``; returns its handle (not yet ready)."""
    env_vars = {**REPLICA_ENV, **(env or {})}
    for var in ("PYTHONPATH", "HF_HUB_OFFLINE", LOG_LEVEL_ENV):
        if var in os.environ:
            env_vars.setdefault(var, os.environ[var])
    # Threaded: concurrent requests reach the engine loop and share its steps.
    actor = ray.remote(EngineReplica)
    handle = actor.options(
        num_cpus=0,
        max_concurrency=64,
        name=name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": env_vars},
    ).remote(model, kv_transfer_config, dict(engine_kwargs or {}))
    assert isinstance(handle, ActorHandle)  # Ray's stubs also allow the class
    return handle


BLOCK_TOKENS = 128  # vLLM's CPU backend block size

#: How deployments size vLLM's CPU primary against the engine's own KV cache.
#: A GPU host has several times more DRAM than HBM (an 8xH100 node: 2 TB of
#: DRAM, 640 GB of HBM of which about half is KV cache), and vLLM's offloading
#: guide sizes ``cpu_bytes_to_use`` to a share of that DRAM: a CPU primary of
#: 4x the engine's cache is a conservative deployment. Benchmarks and the
#: demo use this rule unless an option overrides it.
PRIMARY_PER_ENGINE_BLOCK = 4


def deployment_primary_chunks(engine_blocks: int) -> int:
    """CPU primary chunks for an engine cache of ``engine_blocks`` blocks, sized as a deployment would."""
    return PRIMARY_PER_ENGINE_BLOCK * engine_blocks


def engine_kwargs(max_model_len: int, engine_blocks: int) -> dict[str, JsonValue]:
    """Engine arguments of a small-cache replica (``engine_blocks`` blocks of KV)."""
    return {
        "max_model_len": max_model_len,
        "num_gpu_blocks_override": engine_blocks,
        "enforce_eager": True,
        "disable_log_stats": False,
    }


#: What ``chunk_bytes`` reads from a model's config.json.
MODEL_SHAPE_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size")


def model_config(model: str, option: str = "--model") -> dict[str, object]:
    """``model``'s config.json, checked before anything starts: ``ArgumentError``
    naming ``option`` when ``model`` is not a model directory whose config.json
    gives the decoder's shape (``MODEL_SHAPE_FIELDS``)."""
    what = f"{model!r}"
    if not os.path.exists(model):
        raise ArgumentError(option, f"no such model directory {what}")
    if not os.path.isdir(model):
        raise ArgumentError(option, f"{what} is a file: give a model directory (a Hugging Face checkpoint)")
    path = os.path.join(model, "config.json")
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read())
    except FileNotFoundError:
        raise ArgumentError(option, f"{what} has no config.json: not a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ArgumentError(option, f"cannot read {path!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise ArgumentError(option, f"{path!r} holds a {type(cfg).__name__}, not a JSON object")
    bad = [k for k in MODEL_SHAPE_FIELDS if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    if bad:
        raise ArgumentError(option, f"{path!r} gives no integer {', '.join(bad)}: not a decoder model raykv can size")
    return cfg


def chunk_bytes(model: str, block_tokens: int = BLOCK_TOKENS, dtype_bytes: int = 2) -> int:
    """Bytes of one KV block of ``model`` (K and V, all layers): sizes CPU primaries."""
    cfg: dict[str, Any] = model_config(model)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * block_tokens * dtype_bytes


def model_dtype(model: str) -> str:
    """The model's weight dtype (``torch_dtype`` in its config.json)."""
    return str(model_config(model).get("torch_dtype", "bfloat16"))


#: Memory one replica of the demo and benches takes besides its model's weights: a
#: simulated Ray node (raylet, workers) and a vLLM CPU engine with a 16-block cache.
#: Measured: ~1.1 GiB each (``raykv demo``, 2 replicas of the bench model, 2026-12-03).
REPLICA_BASE_BYTES = 1 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def available_memory_bytes() -> int | None:
    """Memory this process may still use: Linux's MemAvailable, capped by its
    cgroup's limit (a container's); None when neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            found.append(max(int(limit) - current, 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_replicas_fit(replicas: int, model: str | None = None, option: str = "--replicas") -> None:
    """``ArgumentError`` naming ``option`` when ``replicas`` simulated nodes, each with a
    vLLM engine of ``model`` (a directory: its weight files count), cannot fit in the
    memory this machine has available: starting them would stall or be killed."""
    available = available_memory_bytes()
    if available is None:
        return
    weights = 0
    if model is not None and os.path.isdir(model):
        for entry in os.scandir(model):
            if entry.name.endswith(_WEIGHT_SUFFIXES) and entry.is_file():
                weights += entry.stat().st_size
    each = REPLICA_BASE_BYTES + weights
    if replicas * each > available:
        gib = 1 << 30
        raise ArgumentError(
            option,
            f"{replicas} replicas need about {replicas * each / gib:.1f} GiB (each a simulated Ray node with a "
            f"vLLM engine: about {each / gib:.1f} GiB); this machine has {available / gib:.1f} GiB available, "
            f"enough for at most {available // each}",
        )


def start_local_cluster(
    num_nodes: int, object_store_mib: int = 384, model: str | None = None
) -> tuple[Cluster, list[str]]:
    """An embedded Ray of ``num_nodes`` simulated nodes; returns it and its node ids (head first).
    First checks that as many replicas of ``model`` fit in memory (``check_replicas_fit``)."""
    from ray.cluster_utils import Cluster

    check_replicas_fit(num_nodes, model)

    mib = 1024 * 1024
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": object_store_mib * mib, "include_dashboard": False},
    )
    for _ in range(num_nodes - 1):
        cluster.add_node(num_cpus=1, object_store_memory=object_store_mib * mib)
    ray.init(address=cluster.address, log_to_driver=False)
    signals.after_ray_init()
    head = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != head)
    return cluster, nodes


def run_trace(
    name: str,
    nodes: list[str],
    model: str,
    kv_config: EngineConfig | None,
    trace: Sequence[TraceRequest],
    engine_kw: EngineConfig,
    progress: Progress,
    after: Callable[[list[ActorHandle]], T] | None = None,
    before: Callable[[list[ActorHandle]], object] | None = None,
    concurrency: int | None = None,
    warm_prefix: Sequence[int] | None = None,
    output_tokens: int = 1,
) -> tuple[list[Completion], T | None]:
    """Start one replica per node, call ``before(replicas)``, send ``trace`` (requests with
    ``session``, ``turn``, ``replica`` and ``prompt_token_ids``), then ``after(replicas)``,
    and stop the replicas. Returns one result per request (trace order), and what
    ``after`` returned.

    ``concurrency=None`` sends one request at a time and waits for the replica's
    offloads after each (a barrier: what tests of exact hit counts want). Else
    up to ``concurrency`` sessions are in flight, with no barrier (`send_sessions`).
    ``warm_prefix[i]``: prompt tokens of request ``i`` put in its replica's own
    prefix cache first (untimed). ``output_tokens``: tokens generated per request
    (the next turn of a session follows the whole answer; TTFT is to the first).
    """
    from raykv.demo.tiny_model import make_prompt_tokens

    progress.set_description(f"{name}: starting {len(nodes)} vLLM replicas")
    replicas = [start_replica(node, model, kv_config, engine_kw) for node in nodes]
    try:
        ray.get([r.ready.remote() for r in replicas], timeout=600)
        # The first request of an engine pays one-off kernel set-up: not timed.
        ray.get([r.generate.remote(make_prompt_tokens(200, 999 + i)) for i, r in enumerate(replicas)], timeout=600)
        # So does the start of raykv's per-engine actors (a worker process each: a CPU second or so).
        ray.get([r.raykv_started.remote() for r in replicas], timeout=600)
        progress.set_description(f"{name}: {len(trace)} requests")
        if before is not None:
            before(replicas)

        def send(req: TraceRequest, settle: bool) -> ray.ObjectRef[Completion]:
            warm = warm_prefix[req.index] if warm_prefix is not None else 0
            return replicas[req.replica].generate.remote(
                req.prompt_token_ids, max_tokens=output_tokens, settle=settle, warm_prefix_tokens=warm
            )

        if concurrency is None:
            results: list[Completion] = []
            for req in trace:
                results.append(ray.get(send(req, True), timeout=600))
                progress.update(1)
        else:
            results = send_sessions(trace, lambda req: send(req, False), concurrency, progress)
        return results, (after(replicas) if after is not None else None)
    finally:
        for r in replicas:
            try:
                ray.get(r.shutdown.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(r)


def send_sessions(
    trace: Sequence[TraceRequest],
    send: Callable[[TraceRequest], ray.ObjectRef[Completion]],
    concurrency: int,
    progress: Progress,
    timeout_s: float = 600,
) -> list[Completion]:
    """Send ``trace`` as sessions, with no barrier between requests: a session's next
    turn goes out as soon as its previous turn answered; a new session starts once
    fewer than ``concurrency`` are in flight and the previous session's first turn
    answered (sessions arrive one after another, not all at once). ``send(req)``
    returns a Ray ref to the request's result. Returns the results in trace order."""
    if concurrency < 1:
        raise ArgumentError("concurrency", f"must be >= 1, got {concurrency!r}")
    by_session: dict[int, list[TraceRequest]] = {}
    for req in trace:
        by_session.setdefault(req.session, []).append(req)
    turns = {s: sorted(reqs, key=lambda r: r.turn) for s, reqs in by_session.items()}
    waiting = sorted(turns)  # sessions not started yet, in order
    results: dict[int, Completion] = {}
    in_flight: dict[ray.ObjectRef[Completion], TraceRequest] = {}
    active = 0
    last_first: TraceRequest | None = None  # the first turn of the last session started, until it answers

    def start_sessions() -> None:
        nonlocal active, last_first
        while waiting and active < concurrency and last_first is None:
            req = turns[waiting.pop(0)][0]
            in_flight[send(req)] = req
            active += 1
            last_first = req

    start_sessions()
    while in_flight:
        ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"none of {len(in_flight)} requests in flight answered in {timeout_s:.0f} s")
        req = in_flight.pop(ready[0])
        results[req.index] = ray.get(ready[0])
        progress.update(1)
        if req is last_first:
            last_first = None
        later = [r for r in turns[req.session] if r.turn > req.turn]
        if later:
            in_flight[send(later[0])] = later[0]
        else:
            active -= 1
        start_sessions()
    return [results[req.index] for req in trace]
