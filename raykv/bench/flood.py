"""``raykv bench flood``: does a pinned long prefix survive a flood of unrelated prompts?

Prompt caching with a lifetime (``kv_transfer_params={"cache_ttl_s": N}``,
``raykv.core.pins``): a request's blocks stay in raykv's object_store and fs
tiers past LRU for N seconds after their last use. This bench checks the
issue's target: a pinned long prefix survives a flood of unrelated prompts that
cycles every tier's capacity ``--cycles`` times, and the next request that uses
it gets at least 99% of its full blocks from raykv on any replica.

An embedded ``Cluster`` of ``--replicas`` simulated nodes runs a Ray Serve LLM
app of vLLM replicas (one per node; the local bench model, whose prefill costs
what a real model's does per KV byte) with raykv's tiers: each node's object
store and one shared fs root, both sized to ``--tier-prefixes`` times the
prefix's KV bytes (so the pinned prefix stays under ``max_pinned_fraction``
of each). Each replica's engine cache and CPU primary are ``engine_blocks``
(twice the prefix, at least ``ENGINE_BLOCKS``): the flood flushes them too.
The issue's 20480-token prefix needs ``--model bench-long`` (the bench model
with 32768 positions); the default bench model's 4096 fit 3840. Three configurations, each from empty
caches (its own app, namespace and root):

- ``pinned``: the prefix is sent once with ``cache_ttl_s`` (``--ttl``);
- ``unpinned``: the same without a TTL, raykv's plain LRU (the baseline);
- ``all_nodes``: ``raykv warm --all-nodes`` (``raykv.ops.warm.warm``) computes
  the prefix once, pins it, and copies it into every node's object store;
  each replica's first probe should then load it from its own node (the
  object store counters tell local loads from pulls off another node).

Then the flood: batches of distinct random prompts, until every tier stored
``--cycles`` times its capacity (from the tier actors' counters) and no engine
holds a block of the prefix. Then the probes: the prefix plus a new short
suffix each, one at a time, until every replica has served one with none of
the prefix in its engine cache (that request's ``cached_tokens`` came from
raykv) and two more requests met the prefix in their engine's own cache (the
floor). Serve routes by itself: each probe's replica is read from the
directory (the engine that holds the prompt's last block afterwards).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from typing import TYPE_CHECKING, TypedDict, final

from raykv.bench.common import (
    Failed,
    all_at_once,
    bad_option,
    fill_defaults,
    machine,
    median,
    names_option,
    number,
    section,
    table,
    target,
    targets_table,
)
from raykv.bench.routing import (
    BLOCK,
    MODEL_ID,
    URL,
    Usage,
    full_block_tokens,
    usage_of,
)
from raykv.core.wire import JsonValue, Report
from raykv.demo.models import model_positions, resolve_model

if TYPE_CHECKING:
    from raykv.bench.routing import EngineWatch
    from raykv.demo.replicas import Progress
    from raykv.services.cluster import RaykvServices

HELP = "prompt caching: a pinned long prefix through a flood that cycles every tier's capacity (pinned vs unpinned)"

CONFIGS = ("pinned", "unpinned", "all_nodes")
#: The Serve app's root (``raykv warm`` appends ``/v1/completions``).
APP_URL = URL.removesuffix("/v1/completions")
#: The prefix the issue asks for, when the model allows it (the local models do not: 4096 positions).
ISSUE_PREFIX_TOKENS = 20480
#: Engine cache and CPU primary per replica, in blocks of ``BLOCK`` tokens, at least (the flood flushes both).
ENGINE_BLOCKS = 64
#: A flood or probe request that does not answer in this time fails the configuration.
REQUEST_TIMEOUT_S = 300
#: Pause for offloads to land (stores are asynchronous) before tiers are read.
SETTLE_S = 3.0
#: fs block files carry a small header: capacity per block on top of the KV bytes.
FS_HEADER_BYTES = 256
#: Probes that met the prefix in their engine's own cache, for the floor.
FLOOR_PROBES = 2
#: The share of full blocks from raykv the issue asks for.
TARGET_SHARE = 0.99
#: ``all_nodes``: each replica's first request within this x the engine-cache floor's TTFT.
TARGET_VS_FLOOR = 1.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas, one per simulated node (default 2)")
    p.add_argument(
        "--prefix-tokens",
        type=int,
        help=f"the long prefix (default: the issue's {ISSUE_PREFIX_TOKENS} where the model's positions allow "
        "(--model bench-long), else the most full blocks that fit with the suffix: 3840 on the bench model)",
    )
    p.add_argument(
        "--suffix-tokens",
        type=int,
        default=BLOCK,
        help=f"each probe's own new suffix (default {BLOCK}; at least one full block: the directory then tells "
        "which replica served the probe)",
    )
    p.add_argument("--flood-tokens", type=int, help="tokens per flood prompt (default: as long as the prefix)")
    p.add_argument(
        "--tier-prefixes",
        type=float,
        default=2.5,
        help="each tier's capacity, in prefixes' KV bytes (default 2.5; the pin must fit under "
        "max_pinned_fraction 0.5 of it: at least 2)",
    )
    p.add_argument(
        "--cycles", type=float, help="flood until every tier stored this x its capacity (default 3; quick 1.5)"
    )
    p.add_argument("--ttl", type=float, default=3600.0, help="the pinned prefix's cache_ttl_s (default 3600)")
    p.add_argument("--max-flood-prompts", type=int, default=400, help="give up flooding after this many (400)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument(
        "--model",
        help="'bench' (default: the local bench model, 4096 positions), 'bench-long' (the same, 32768 positions), "
        "'tiny', or a model directory",
    )
    p.add_argument("--tiny", action="store_true", help="the tiny local model (same as --model tiny)")


class Probe(TypedDict):
    """One request of prefix + a new suffix after the flood."""

    replica: str | None  # the replica that served it (None: not attributed)
    kind: str  # "first": no prefix block in its engine before; "engine": the whole prefix there; else "other"
    engine_blocks_before: int  # prefix blocks the serving engine held before it was sent
    tier_blocks_before: int  # prefix blocks (full) raykv's tiers held before it was sent
    cached_tokens: int
    raykv_share: float  # cached tokens / the prefix's tokens in full blocks ("first" probes: all from raykv)
    ttft_ms: float
    local_blocks: int  # blocks loaded from the serving replica's own node's object store
    remote_blocks: int  # blocks an object store pulled from another node's


class TierFigures(TypedDict):
    """One tier actor over the flood."""

    tier: str  # object_store@<node> or fs
    capacity_bytes: int
    flood_stored_bytes: int
    cycles: float  # flood stored bytes / capacity
    evicted_blocks: int  # during the flood
    pinned_blocks: int  # after the flood
    pins_refused: int  # over the whole run (tier_cap + tenant_quota)


@final  # so that ``"error" in r`` tells a failure (``Failed``) from a summary
class ConfigSummary(TypedDict):
    """One configuration's figures."""

    flood_prompts: int
    flood_s: float
    tiers: list[TierFigures]
    probes: list[Probe]
    next_share: float | None  # the first probe after the flood, whichever replica
    next_ttft_ms: float | None
    first_share_min: float | None  # the worst replica's first probe
    replicas_probed: int  # replicas that served a "first" probe
    first_ttft_ms: float | None  # median over the "first" probes
    first_all_local: bool  # every "first" probe loaded the whole prefix from its own node's object store
    floor_ttft_ms: float | None  # median over the "engine" probes
    ttft_vs_floor: float | None


class FloodResult(TypedDict):
    """The JSON result of ``raykv bench flood``."""

    benchmark: str
    machine: Report
    replicas: int
    prefix_tokens: int
    cacheable_prefix_tokens: int
    prefix_note: str
    suffix_tokens: int
    flood_tokens: int
    block_bytes: int
    object_store_capacity_bytes: int
    fs_capacity_bytes: int
    cycles_target: float
    ttl_s: float
    model: str
    configs: dict[str, ConfigSummary | Failed]
    targets: list[Report]


def prefix_limit(suffix_tokens: int, max_model_len: int) -> int:
    """The longest prefix in full blocks that fits ``max_model_len`` with the suffix and one output token
    (3840 tokens with the default suffix on the bench model's 4096 positions)."""
    return (max_model_len - suffix_tokens - 1) // BLOCK * BLOCK


def engine_blocks(args: argparse.Namespace) -> int:
    """Each replica's engine cache and CPU primary, in blocks: twice the prefix (at least
    ``ENGINE_BLOCKS``), and room for the longest prompt (vLLM wants that much)."""
    longest = max(args.prefix_tokens, args.flood_tokens) + args.suffix_tokens + 1
    prefix_blocks = full_block_tokens(args.prefix_tokens) // BLOCK
    return max(ENGINE_BLOCKS, 2 * prefix_blocks + 4, -(-longest // BLOCK) + 2)


def check_options(args: argparse.Namespace) -> tuple[list[str], str]:
    """Apply ``--quick`` and defaults, check every option (``ValueError`` naming it)
    before a cluster starts; returns the configurations and a note on the prefix length.
    Sets ``args.max_model_len``: the model's positions (its longest prompt)."""
    fill_defaults(args, {"cycles": 3.0}, {"cycles": 1.5})
    if args.quick and args.prefix_tokens is None:
        args.prefix_tokens = 1024
    if args.replicas < 2:
        raise bad_option("--replicas: at least 2 (the prefix must come back on a replica that did not compute it)")
    if args.suffix_tokens < BLOCK:
        raise bad_option(f"--suffix-tokens: at least {BLOCK} (a full block of the probe's own tells who served it)")
    max_len = args.max_model_len = model_positions(args)
    limit = prefix_limit(args.suffix_tokens, max_len)
    note = ""
    if args.prefix_tokens is None:
        args.prefix_tokens = min(ISSUE_PREFIX_TOKENS, limit)
        if args.prefix_tokens < ISSUE_PREFIX_TOKENS:
            note = (
                f"the issue's {ISSUE_PREFIX_TOKENS}-token prefix does not fit the model's max_model_len "
                f"{max_len}: {args.prefix_tokens} tokens, the most full blocks that do (--model bench-long: 32768)"
            )
    if args.prefix_tokens < BLOCK:
        raise bad_option(f"--prefix-tokens: at least {BLOCK} (one block)")
    if args.prefix_tokens > limit:
        raise bad_option(
            f"--prefix-tokens + --suffix-tokens + 1 output token: at most {max_len} "
            f"(the model's max_model_len): --prefix-tokens {args.prefix_tokens} > {limit}"
        )
    if args.flood_tokens is None:
        args.flood_tokens = args.prefix_tokens
    if not BLOCK <= args.flood_tokens < max_len:
        raise bad_option(f"--flood-tokens: from {BLOCK} (one block) to under {max_len} (the model's max_model_len)")
    if args.tier_prefixes < 2:
        raise bad_option("--tier-prefixes: at least 2 (the pinned prefix must fit under max_pinned_fraction 0.5)")
    if args.cycles <= 0 or args.ttl <= 0 or args.max_flood_prompts < 1:
        raise bad_option("--cycles and --ttl: above 0; --max-flood-prompts: at least 1")
    return names_option("--configs", args.configs, CONFIGS), note


def run(args: argparse.Namespace) -> FloodResult:
    """Both configurations, each from empty caches; returns the JSON result."""
    import ray

    from raykv.bench.serve_app import start_cluster
    from raykv.demo.replicas import chunk_bytes
    from raykv.integrations.vllm import require_vllm

    configs, note = check_options(args)
    require_vllm()
    model, model_name = resolve_model(args)
    block_bytes = chunk_bytes(model)
    prefix_blocks = full_block_tokens(args.prefix_tokens) // BLOCK
    tier_blocks = max(2, round(args.tier_prefixes * prefix_blocks))
    capacities = (tier_blocks * block_bytes, tier_blocks * (block_bytes + FS_HEADER_BYTES))
    info = machine()
    cluster = start_cluster(args.replicas, model)
    per: dict[str, ConfigSummary | Failed] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="raykv-bench-flood-") as root:
            for name in configs:
                try:
                    per[name] = _run_config(name, model, f"{root}/{name}", capacities, block_bytes, args)
                except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the other
                    per[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {
        "benchmark": "flood",
        "machine": info,
        "replicas": args.replicas,
        "prefix_tokens": args.prefix_tokens,
        "cacheable_prefix_tokens": full_block_tokens(args.prefix_tokens),
        "prefix_note": note,
        "suffix_tokens": args.suffix_tokens,
        "flood_tokens": args.flood_tokens,
        "block_bytes": block_bytes,
        "object_store_capacity_bytes": capacities[0],
        "fs_capacity_bytes": capacities[1],
        "cycles_target": args.cycles,
        "ttl_s": args.ttl,
        "model": model_name,
        "configs": per,
        "targets": _targets(per, args.replicas),
    }


def _run_config(
    name: str, model: str, root: str, capacities: tuple[int, int], block_bytes: int, args: argparse.Namespace
) -> ConfigSummary:
    from ray import serve
    from tqdm import tqdm

    import raykv
    from raykv.bench.routing import EngineWatch
    from raykv.bench.serve_app import bench_app
    from raykv.demo.tiny_model import make_prompt_tokens

    namespace = f"raykv-bench-flood-{name}"
    os_cap, fs_cap = capacities
    tiers: list[JsonValue] = [
        {"type": "object_store", "capacity_bytes": os_cap},
        {"type": "fs", "root": root, "fsync": False, "capacity_bytes": fs_cap},
    ]
    services = raykv.start({"namespace": namespace, "directory_shards": 2, "tiers": tiers})
    blocks = engine_blocks(args)
    app = bench_app(
        model,
        model_id=MODEL_ID,
        replicas=args.replicas,
        router="default",
        raykv={"namespace": namespace, "tiers": tiers},
        cpu_bytes=blocks * block_bytes,
        engine_cache=True,  # the directory then tells which engine holds the prefix, and who served a probe
        engine_kwargs={"max_model_len": min(args.max_model_len, blocks * BLOCK), "num_gpu_blocks_override": blocks},
    )
    params: dict[str, JsonValue] | None = None if name == "unpinned" else {"cache_ttl_s": args.ttl}
    progress = tqdm(file=sys.stderr, disable=args.no_progress, unit="req", desc=name)
    try:
        serve.run(app, name="raykv-bench-flood", route_prefix="/", blocking=False)
        watch = EngineWatch(services, model)
        watch.wait_engines(args.replicas)
        _warm_up(args.replicas)
        prefix = make_prompt_tokens(args.prefix_tokens, 10_000)
        if name == "all_nodes":
            _warm_all_nodes(services, prefix, args.ttl, args.replicas)
        else:
            complete_with(prefix + make_prompt_tokens(args.suffix_tokens, 20_000), params)
        progress.update(1)
        time.sleep(SETTLE_S)
        before = _tier_figures(services)
        t0 = time.perf_counter()
        sent = _flood(services, watch, prefix, before, args, progress)
        flood_s = time.perf_counter() - t0
        time.sleep(SETTLE_S)
        tier_rows = _tier_rows(before, _tier_figures(services))
        probes = _probe(services, watch, prefix, params, args, progress)
        return _summary(sent, flood_s, tier_rows, probes, args.replicas, full_block_tokens(args.prefix_tokens) // BLOCK)
    finally:
        progress.close()
        serve.delete("raykv-bench-flood")
        services.shutdown()


def complete_with(
    prompt: list[int], params: dict[str, JsonValue] | None, timeout_s: float = REQUEST_TIMEOUT_S
) -> tuple[Usage, float]:
    """One one-token completion of ``prompt`` with ``kv_transfer_params`` ``params``
    (None: none): its usage and latency in seconds (the TTFT)."""
    import requests

    from raykv.bench.common import as_json

    body: dict[str, JsonValue] = {"model": MODEL_ID, "prompt": list(prompt), "max_tokens": 1, "temperature": 0.0}
    if params is not None:
        body["kv_transfer_params"] = params
    t0 = time.perf_counter()
    r = requests.post(URL, json=body, timeout=timeout_s)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return usage_of(section(as_json(r.json())).get("usage")), seconds


def _warm_all_nodes(services: RaykvServices, prefix: list[int], ttl_s: float, replicas: int) -> None:
    """``raykv warm --all-nodes`` of ``prefix``: every node's object store must end up holding it."""
    from raykv.ops.warm import warm

    warmed = warm(services, [prefix], ttl_s, url=APP_URL, model=MODEL_ID, all_nodes=True)
    copies = warmed.replicated
    if copies is None or copies.errors or len(copies.per_node) < replicas:
        raise RuntimeError(f"warm --all-nodes did not reach every node: {copies.report() if copies else None}")


def _errors_of(prompts: list[list[int]]) -> list[BaseException]:
    """Send every prompt at once; the errors of those that failed."""
    results = all_at_once(lambda prompt: complete_with(prompt, None), prompts)
    return [r for r in results if isinstance(r, BaseException)]


def _warm_up(replicas: int) -> None:
    """Kernel set-up on every replica (short prompts nothing else shares)."""
    from raykv.demo.tiny_model import make_prompt_tokens

    failed = _errors_of([make_prompt_tokens(2 * BLOCK + 7, 90_000 + i) for i in range(3 * replicas)])
    if failed:
        raise RuntimeError(f"the app failed warm-up requests: {failed[0]!r}")


def _tier_figures(services: RaykvServices) -> dict[str, Report]:
    """Each tier actor's figures (``stats().figures``), keyed ``object_store@<node>`` or ``fs``."""
    import ray

    from raykv.core.wire import PLASMA, SHARED
    from raykv.holders.messages import HolderStats

    out: dict[str, Report] = {}
    for info in services.holders(timeout=30):
        if info.medium not in (PLASMA, SHARED):
            continue
        actor = ray.get_actor(info.actor_name, namespace=info.namespace)
        ref: ray.ObjectRef[HolderStats] = actor.stats.remote()
        key = f"{info.tier_type}@{info.node_id[:8]}" if info.node_id else info.tier_type
        out[key] = dict(ray.get(ref, timeout=60).figures)
    return out


def _counter(figures: Report, name: str) -> int:
    """A tier's counter (the object store's are under ``counters``, the fs root's at the top)."""
    counters = section(figures.get("counters")) or figures
    return int(number(counters.get(name)) or 0)


def _stored_bytes(figures: Report) -> int:
    """Bytes a tier has stored since it started (the fs root: committed files x their mean size)."""
    if "counters" in figures:
        return _counter(figures, "stored_bytes")
    files, size = number(figures.get("files")) or 0, number(figures.get("bytes")) or 0
    per_file = size / files if files else 0
    return int(_counter(figures, "committed") * per_file)


def _evicted(figures: Report) -> int:
    return _counter(figures, "evicted_blocks") if "counters" in figures else _counter(figures, "evicted")


def _tier_rows(before: dict[str, Report], after: dict[str, Report]) -> list[TierFigures]:
    """Per tier actor: what the flood stored and evicted, against its capacity."""
    rows: list[TierFigures] = []
    for key, now in sorted(after.items()):
        then = before.get(key, {})
        cap = int(number(now.get("capacity_bytes")) or 0)
        stored = _stored_bytes(now) - _stored_bytes(then)
        refused = _counter(now, "pins_refused_tier_cap") + _counter(now, "pins_refused_tenant_quota")
        rows.append(
            {
                "tier": key,
                "capacity_bytes": cap,
                "flood_stored_bytes": stored,
                "cycles": stored / cap if cap else float("nan"),
                "evicted_blocks": _evicted(now) - _evicted(then),
                "pinned_blocks": int(number(now.get("pinned_blocks")) or 0),
                "pins_refused": refused,
            }
        )
    return rows


def _flood(
    services: RaykvServices,
    watch: EngineWatch,
    prefix: list[int],
    before: dict[str, Report],
    args: argparse.Namespace,
    progress: Progress,
) -> int:
    """Batches of new random prompts (two per replica at once) until every tier stored
    ``--cycles`` x its capacity and no engine holds a prefix block; returns the prompts sent."""
    from raykv.demo.tiny_model import make_prompt_tokens

    sent = 0
    batch = 2 * args.replicas
    while sent < args.max_flood_prompts:
        prompts = [make_prompt_tokens(args.flood_tokens, 30_000 + sent + i) for i in range(batch)]
        failed = _errors_of(prompts)
        if failed:
            raise RuntimeError(f"a flood request failed: {failed[0]!r}")
        sent += batch
        progress.update(batch)
        rows = _tier_rows(before, _tier_figures(services))
        cycled = len(rows) >= args.replicas + 1 and all(r["cycles"] >= args.cycles for r in rows)
        if cycled and not watch.leading(prefix):
            return sent
    raise RuntimeError(f"--max-flood-prompts {args.max_flood_prompts}: the tiers were not cycled {args.cycles}x")


def _tier_blocks(services: RaykvServices, model: str, tokens: list[int]) -> int:
    """Leading full blocks of ``tokens`` that raykv's tiers (any node's object store, the fs root) hold."""
    from raykv.core.wire import PLASMA, SHARED
    from raykv.integrations.vllm.hashing import block_hashes
    from raykv.serve.routing import EngineLayout, request_keys

    found = [(t, i) for t, i in services.identities().items() if i.model == model]
    if not found:
        return 0
    layout = EngineLayout.from_identity(*found[0])
    _, keys = request_keys(block_hashes(tokens, layout.tokens_per_hash), layout)
    n = 0
    for holders in services.directory.lookup(keys) if keys else []:
        if not any(h.medium in (PLASMA, SHARED) for h in holders):
            break
        n += 1
    return n * layout.blocks_per_chunk


def _probe(
    services: RaykvServices,
    watch: EngineWatch,
    prefix: list[int],
    params: dict[str, JsonValue] | None,
    args: argparse.Namespace,
    progress: Progress,
) -> list[Probe]:
    """Prefix + a new suffix, one at a time, until every replica served a "first" probe
    and ``FLOOR_PROBES`` met the whole prefix in their engine (or 8 per replica were sent)."""
    from raykv.demo.tiny_model import make_prompt_tokens

    cacheable = full_block_tokens(args.prefix_tokens)
    probes: list[Probe] = []
    firsts: set[str] = set()
    for i in range(8 * args.replicas):
        prompt = prefix + make_prompt_tokens(args.suffix_tokens, 40_000 + i)
        engines: Counter[str] = watch.leading(prefix)
        tier_blocks = _tier_blocks(services, watch.model, prefix)
        before = _tier_figures(services)
        usage, seconds = complete_with(prompt, params)
        progress.update(1)
        replica = watch.computed_by(prompt, timeout_s=10.0)
        local, remote = _object_store_loads(before, _tier_figures(services))
        had = engines.get(replica, 0) if replica else 0
        kind = "other"
        if replica is not None and had == 0 and replica not in firsts:
            kind = "first"
            firsts.add(replica)
        elif replica is not None and had * BLOCK >= cacheable:
            kind = "engine"
        probes.append(
            {
                "replica": replica,
                "kind": kind,
                "engine_blocks_before": had,
                "tier_blocks_before": tier_blocks,
                "cached_tokens": usage.cached_tokens,
                "raykv_share": min(usage.cached_tokens, cacheable) / cacheable,
                "ttft_ms": seconds * 1000,
                "local_blocks": local,
                "remote_blocks": remote,
            }
        )
        if len(firsts) >= args.replicas and sum(p["kind"] == "engine" for p in probes) >= FLOOR_PROBES:
            break
    return probes


def _object_store_loads(before: dict[str, Report], after: dict[str, Report]) -> tuple[int, int]:
    """Blocks the object store actors loaded between two readings: (from their own node, pulled from another)."""
    hits = remote = 0
    for key, now in after.items():
        if "counters" not in now:
            continue
        then = before.get(key, {})
        hits += _counter(now, "hits") - _counter(then, "hits")
        remote += _counter(now, "hits_remote") - _counter(then, "hits_remote")
    return hits - remote, remote


def _summary(
    sent: int, flood_s: float, tiers: list[TierFigures], probes: list[Probe], replicas: int, prefix_blocks: int
) -> ConfigSummary:
    firsts = [p for p in probes if p["kind"] == "first"]
    floor = [p["ttft_ms"] for p in probes if p["kind"] == "engine"]
    first_ttft = median([p["ttft_ms"] for p in firsts]) if firsts else None
    floor_ttft = median(floor) if floor else None
    return {
        "flood_prompts": sent,
        "flood_s": flood_s,
        "tiers": tiers,
        "probes": probes,
        "next_share": probes[0]["raykv_share"] if probes else None,
        "next_ttft_ms": probes[0]["ttft_ms"] if probes else None,
        "first_share_min": min(p["raykv_share"] for p in firsts) if firsts else None,
        "replicas_probed": len(firsts),
        "first_ttft_ms": first_ttft,
        "first_all_local": bool(firsts)
        and all(p["remote_blocks"] == 0 and p["local_blocks"] >= prefix_blocks for p in firsts),
        "floor_ttft_ms": floor_ttft,
        "ttft_vs_floor": first_ttft / floor_ttft if first_ttft is not None and floor_ttft else None,
    }


def _targets(per: dict[str, ConfigSummary | Failed], replicas: int) -> list[Report]:
    out: list[Report] = []
    r = per.get("pinned")
    if r is not None and "error" not in r:
        unpinned = per.get("unpinned")
        base = "" if unpinned is None or "error" in unpinned else f"; unpinned: {_share(unpinned['first_share_min'])}"
        cycled = min((t["cycles"] for t in r["tiers"]), default=float("nan"))
        out.append(
            target(
                "pinned prefix after the flood: full blocks from raykv, worst replica's first request",
                r["first_share_min"] if r["replicas_probed"] else None,
                TARGET_SHARE,
                detail=f"{r['replicas_probed']} replicas probed, least-cycled tier {cycled:.1f}x{base}",
            )
        )
    a = per.get("all_nodes")
    if a is not None and "error" not in a:
        every = a["replicas_probed"] == replicas and a["first_all_local"]
        local = ", ".join(f"{p['local_blocks']}/{p['remote_blocks']}" for p in a["probes"] if p["kind"] == "first")
        line = target(
            "warm --all-nodes: each replica's first request, TTFT x the engine-cache floor",
            a["ttft_vs_floor"],
            TARGET_VS_FLOOR,
            higher_is_better=False,
            detail=f"{a['replicas_probed']}/{replicas} replicas probed, every one from its own node: {every} "
            f"(blocks local/pulled: {local or '-'}); worst share {_share(a['first_share_min'])}",
        )
        if not every:  # a pull from another node, or a replica not probed, misses whatever the TTFT
            line["passed"] = False
        out.append(line)
    return out


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def format_result(result: FloodResult) -> str:
    """The configurations' table, each tier's flood figures, and the targets."""
    rows: list[list[object]] = []
    tier_rows: list[list[object]] = []
    for name, r in result["configs"].items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"][:70], "", "", "", "", "", "", "", ""])
            continue
        rows.append(
            [
                name,
                _share(r["next_share"]),
                r["next_ttft_ms"],
                _share(r["first_share_min"]),
                f"{r['replicas_probed']}/{result['replicas']}",
                "yes" if r["first_all_local"] else "no",
                r["first_ttft_ms"],
                r["floor_ttft_ms"],
                r["ttft_vs_floor"],
                f"{r['flood_prompts']} in {r['flood_s']:.0f} s",
            ]
        )
        for t in r["tiers"]:
            tier_rows.append(
                [
                    f"{name} {t['tier']}",
                    f"{t['capacity_bytes'] / 2**20:.1f}",
                    f"{t['flood_stored_bytes'] / 2**20:.1f}",
                    f"{t['cycles']:.1f}",
                    t["evicted_blocks"],
                    t["pinned_blocks"],
                    t["pins_refused"],
                ]
            )
    head = (
        f"raykv bench flood: a {result['prefix_tokens']}-token prefix ({result['cacheable_prefix_tokens']} in full "
        f"blocks, {result['cacheable_prefix_tokens'] // BLOCK * result['block_bytes'] / 2**20:.1f} MiB of KV), "
        f"flood prompts of {result['flood_tokens']} tokens until every tier stored {result['cycles_target']}x its "
        f"capacity, {result['replicas']} replicas; model {result['model']}; pinned: cache_ttl_s {result['ttl_s']:.0f}"
    )
    note = result["prefix_note"]
    body = table(
        [
            "config",
            "next request",
            "its TTFT ms",
            "worst replica",
            "replicas",
            "own node",
            "TTFT ms",
            "floor ms",
            "x floor",
            "flood",
        ],
        rows,
    )
    tiers = table(
        ["tier", "capacity MiB", "flood stored MiB", "x capacity", "evicted blocks", "pinned blocks", "pins refused"],
        tier_rows,
    )
    legend = (
        "next request: the first probe after the flood (whichever replica), its prefix blocks from raykv "
        "(cached_tokens over the full-block tokens); worst replica: the least of each replica's first probe "
        "(none of the prefix in its engine cache before; unpinned, a later replica's may find the copy the "
        "first one stored again); own node: every first probe loaded the whole prefix from its own node's "
        "object store, none pulled from another node; TTFT ms: their median; floor ms: probes whose engine "
        "held the whole prefix "
        "(same shape: the prefix + a new suffix); x floor: TTFT ms / floor ms."
    )
    return "\n\n".join(filter(None, [head, note, body, tiers, legend, targets_table(result["targets"])]))
