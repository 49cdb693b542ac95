"""Pins (prompt caching with a lifetime, ``kv_transfer_params["cache_ttl_s"]``) with
real vLLM replicas on a two-node ``ray.cluster_utils.Cluster``.

Replica A runs on the worker node, replica B on the head. Both share the
object_store tier (one actor per node, a small capacity) and one fs root (a
small capacity). A stores and floods; a repeat goes to B, whose engine cache
and CPU primary never saw the prompt, so a hit there is raykv's. The module
covers the issue's "done when": a pinned prefix survives a flood that evicts
its unpinned twin; a pin expires and the block is the next one evicted; the
tenant-quota and tier caps refuse pins (counted) while the request is served
and its blocks cached unpinned; invalidation removes pinned blocks; and (last:
it kills the worker node) a pin on a dead node's object store leaves the
directory with the node while the pinned fs copy still serves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.demo.messages import ReplicaReady
from raykv.demo.replicas import start_replica
from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import raykv_kv_transfer_config
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

NAMESPACE = "raykv-vllm-pins"
MIB = 1024 * 1024
BLOCK_TOKENS = 128
CHUNK = 128 << 10  # one 128-token block of the tiny model
FILE_EST = CHUNK + 256  # an fs block file: the block and its header (64-byte aligned; keys < 224 bytes)
LONG = 7 * BLOCK_TOKENS + 105  # 1001 tokens: 7 full blocks
SHORT = 3 * BLOCK_TOKENS + 1  # 3 full blocks
ENGINE = {"max_model_len": 2048, "num_gpu_blocks_override": 20, "enforce_eager": True}
TIER_BLOCKS = 24  # each tier holds 24 blocks: its pins may take 12 (max_pinned_fraction 0.5)
OS_CAPACITY = TIER_BLOCKS * CHUNK
FS_CAPACITY = TIER_BLOCKS * FILE_EST
TENANT = "tenant-quota"
TENANT_QUOTA_BLOCKS = 4  # its pins may take 2 blocks: a 3-block prompt's are refused
LONG_TTL_S = 600.0
SHORT_TTL_S = 12.0  # outlives a 5-prompt flood on a slow host; the test waits for it to pass


def _full(tokens: list[int]) -> int:
    return len(tokens) // BLOCK_TOKENS


@dataclass
class Pins:
    a: Any  # the replica on the worker node (stores, floods)
    b: Any  # the replica on the head node (repeats)
    services: Any
    cluster: Any
    worker: str
    head: str
    os_a: Any
    os_b: Any
    fs: Any
    model: str
    seeds: Iterator[int] = field(default_factory=lambda: iter(range(1000, 100000)))

    def prompt(self, n_tokens: int = LONG) -> list[int]:
        return make_prompt_tokens(n_tokens, next(self.seeds))


@pytest.fixture(scope="module")
def pins(vllm_env, tiny_model, make_ray_cluster, tmp_path_factory) -> Iterator[Pins]:
    # raykv's services and the fs root's actor start while the head is the only node,
    # so they live there and outlive the worker node (the last test removes it).
    rc = make_ray_cluster(head={"num_cpus": 2, "object_store_memory": 256 * MIB})
    head = rc.cluster.head_node.node_id
    root = str(tmp_path_factory.mktemp("raykv-pins-fs") / "kv")
    tiers = [
        {"type": "object_store", "capacity_bytes": OS_CAPACITY, "tenant_quotas": {TENANT: TENANT_QUOTA_BLOCKS * CHUNK}},
        {
            "type": "fs",
            "root": root,
            "fsync": False,
            "capacity_bytes": FS_CAPACITY,
            "tenant_quotas": {TENANT: TENANT_QUOTA_BLOCKS * FILE_EST},
        },
    ]
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 2, "tiers": tiers[1:]})
    worker = rc.cluster.add_node(num_cpus=2, object_store_memory=256 * MIB).node_id
    wait_until(lambda: worker in {n["NodeID"] for n in ray.nodes() if n["Alive"]}, timeout_s=60, what="the worker node")
    services.start_tier_services(tiers[0], "tiers[0]")  # an object store actor per node
    cfg = raykv_kv_transfer_config({"namespace": NAMESPACE, "tiers": tiers}, cpu_bytes=64 * CHUNK)
    a, b = start_replica(worker, tiny_model, cfg, ENGINE), start_replica(head, tiny_model, cfg, ENGINE)
    ready: list[ReplicaReady] = ray.get([a.ready.remote(), b.ready.remote()], timeout=600)
    assert [r.node_id for r in ready] == [worker, head]
    state = Pins(
        a=a,
        b=b,
        services=services,
        cluster=rc.cluster,
        worker=worker,
        head=head,
        os_a=ray.get_actor(naming.object_store_actor(worker), namespace=NAMESPACE),
        os_b=ray.get_actor(naming.object_store_actor(head), namespace=NAMESPACE),
        fs=ray.get_actor(naming.fs_actor(root), namespace=NAMESPACE),
        model=tiny_model,
    )
    yield state
    for r in (a, b):  # A is gone with its node after the last test
        try:
            ray.get(r.shutdown.remote(), timeout=60)
        except Exception:
            pass
        ray.kill(r)
    services.shutdown()


# -- helpers ---------------------------------------------------------------------------
def _figures(actor: Any) -> dict[str, Any]:
    return dict(ray.get(actor.stats.remote(), timeout=60).figures)


def _counter(figures: Mapping[str, Any], name: str) -> int:
    """A tier actor's counter (the object store's are under ``counters``, the fs root's at the top)."""
    return int(figures.get("counters", figures).get(name, 0))


def _keys(actor: Any) -> set[bytes]:
    return set(ray.get(actor.keys.remote(), timeout=60))


def _send(pins: Pins, tokens: list[int], params: dict[str, Any] | None = None) -> tuple[Any, list[bytes]]:
    """Send ``tokens`` to replica A (cold: nothing of it is cached) and wait until its
    full blocks are in A's object store and in the fs root; the answer and their keys."""
    before = _keys(pins.os_a)
    # settle: the engine is idle and its offloads are done (an idle engine used to step on
    # an answered but unpolled directory lookup until settle waited its 30 s out); then
    # the tiers' keys tell that the stores landed
    out = ray.get(pins.a.generate.remote(tokens, kv_transfer_params=params, settle=True), timeout=600)
    assert out.cached_tokens == 0, "a prompt sent to replica A was not cold"
    n = _full(tokens)

    def landed() -> set[bytes]:
        fresh = _keys(pins.os_a) - before
        return fresh if len(fresh) >= n else set()

    new = wait_until(
        landed,
        timeout_s=60,
        what=f"the prompt's {n} blocks in the worker's object store",
    )
    assert len(new) == n, f"{len(new)} new blocks in the object store for a prompt of {n}"
    wait_until(lambda: new <= _keys(pins.fs), timeout_s=60, what="the prompt's blocks in the fs root")
    return out, sorted(new)


def _store(pins: Pins, tokens: list[int], params: dict[str, Any] | None = None) -> list[bytes]:
    """``_send``'s keys."""
    return _send(pins, tokens, params)[1]


def _flood(pins: Pins, blocks: int) -> list[list[bytes]]:
    """Distinct unpinned long prompts through replica A, ``blocks`` blocks at least; their keys."""
    return [_store(pins, pins.prompt()) for _ in range(math.ceil(blocks / (LONG // BLOCK_TOKENS)))]


def _held(actor: Any, keys: list[bytes]) -> list[bool]:
    held = _keys(actor)
    return [k in held for k in keys]


def _file_bytes(fs_figures: Mapping[str, Any]) -> int:
    """The size of one fs block file (all are one block of the same model)."""
    files, size = int(fs_figures["files"]), int(fs_figures["bytes"])
    assert files and size % files == 0, fs_figures
    return size // files


def _file_size(pins: Pins) -> int:
    """The fs root's block file size (an unpinned prompt is stored first when it holds none)."""
    if not _figures(pins.fs)["files"]:
        _store(pins, pins.prompt(SHORT))
    return _file_bytes(_figures(pins.fs))


def _predict_files(
    n: int, size: int, figures: Mapping[str, Any], tenant: str = "", quota: int | None = None
) -> dict[str, int]:
    """What pinning ``n`` new fs files of ``size`` bytes does, one file at a time
    (``raykv.core.pins``: the tier cap first, then the tenant's share of its quota)."""
    frac = float(figures["max_pinned_fraction"])
    total, mine = int(figures["pinned_bytes"]), int(figures["tenant_pinned_bytes"].get(tenant, 0))
    out = {"pinned": 0, "tier_cap": 0, "tenant_quota": 0}
    for _ in range(n):
        if total + size > frac * int(figures["capacity_bytes"]):
            out["tier_cap"] += 1
        elif quota is not None and mine + size > frac * quota:
            out["tenant_quota"] += 1
        else:
            out["pinned"] += 1
            total, mine = total + size, mine + size
    return out


# -- tests -----------------------------------------------------------------------------
def test_a_flood_evicts_the_unpinned_prompt_and_the_pinned_one_survives(pins) -> None:
    os0, fs0 = _figures(pins.os_a), _figures(pins.fs)
    pinned, twin = pins.prompt(), pins.prompt()
    on_a, p_keys = _send(pins, pinned, {"cache_ttl_s": LONG_TTL_S})
    n = _full(pinned)
    u_keys = _store(pins, twin)
    os1, fs1 = _figures(pins.os_a), _figures(pins.fs)
    assert os1["pinned_blocks"] - os0["pinned_blocks"] == n, os1
    assert fs1["pinned_blocks"] - fs0["pinned_blocks"] == n, fs1
    assert os1["pin_expiries"] and os1["pin_expiries"][0]["seconds_left"] > LONG_TTL_S - 120, os1["pin_expiries"]

    flood = _flood(pins, 3 * TIER_BLOCKS)
    os2, fs2 = _figures(pins.os_a), _figures(pins.fs)
    stored = _counter(os2, "stored_bytes") - _counter(os1, "stored_bytes")
    assert stored >= 3 * os2["capacity_bytes"], (stored, os2["capacity_bytes"])  # cycled three times
    committed = _counter(fs2, "committed") - _counter(fs1, "committed")
    assert committed * _file_bytes(fs2) >= 3 * fs2["capacity_bytes"], (committed, fs2["capacity_bytes"])
    assert _counter(os2, "evicted_blocks") - _counter(os1, "evicted_blocks") >= 2 * TIER_BLOCKS
    assert not any(_held(pins.os_a, flood[0])), "the flood did not evict its own first prompt"
    assert all(_held(pins.os_a, p_keys)), "the worker's object store evicted a pinned block"
    assert all(_held(pins.fs, p_keys)), "the fs root evicted a pinned block"
    assert not any(_held(pins.os_a, u_keys)), "the unpinned twin survived a flood of three capacities"
    assert not any(_held(pins.fs, u_keys)), "the unpinned twin survived a flood of three capacities (fs)"
    assert os2["pinned_blocks"] == os1["pinned_blocks"] and fs2["pinned_blocks"] == fs1["pinned_blocks"]

    on_b = ray.get(
        pins.b.generate.remote(pinned, kv_transfer_params={"cache_ttl_s": LONG_TTL_S}, settle=True), timeout=600
    )
    assert on_b.cached_tokens == n * BLOCK_TOKENS, "the pinned prompt was not served from raykv on the other node"
    assert on_b.token_ids == on_a.token_ids and on_b.top_logprobs == on_a.top_logprobs
    twin_on_b = ray.get(pins.b.generate.remote(twin, settle=True), timeout=600)
    assert twin_on_b.cached_tokens == 0, "the evicted unpinned twin was served"


def test_an_expired_pin_is_the_next_block_evicted(pins) -> None:
    os0, fs0 = _figures(pins.os_a), _figures(pins.fs)
    expiring = pins.prompt(SHORT)
    n = _full(expiring)
    assert os0["pinned_bytes"] + n * CHUNK <= os0["max_pinned_fraction"] * os0["capacity_bytes"], (
        "no room under the cap"
    )
    older = {"object store": _keys(pins.os_a), "fs root": _keys(pins.fs)}
    t0 = time.monotonic()
    e_keys = _store(pins, expiring, {"cache_ttl_s": SHORT_TTL_S})
    os1, fs1 = _figures(pins.os_a), _figures(pins.fs)
    assert os1["pinned_blocks"] == os0["pinned_blocks"] + n, os1
    assert fs1["pinned_blocks"] == fs0["pinned_blocks"] + n, fs1

    # A flood of one capacity: every unpinned block older than the pinned prompt goes.
    flood = _flood(pins, TIER_BLOCKS + 7)
    os2, fs2 = _figures(pins.os_a), _figures(pins.fs)
    assert time.monotonic() - t0 < SHORT_TTL_S, "the flood outlasted the pin: raise SHORT_TTL_S"
    for name, actor, before in (("object store", pins.os_a, os0), ("fs root", pins.fs, fs0)):
        left = older[name] & _keys(actor)  # of the blocks held before: the pinned ones only
        assert len(left) == before["pinned_blocks"], (
            f"{name}: {len(left)} older blocks left, {before['pinned_blocks']} pinned"
        )
    assert not any(_held(pins.os_a, flood[0])) and not any(_held(pins.fs, flood[0]))
    assert all(_held(pins.os_a, e_keys)) and all(_held(pins.fs, e_keys)), "a pinned block went before its TTL"
    assert os2["pinned_blocks"] == os1["pinned_blocks"] and fs2["pinned_blocks"] == fs1["pinned_blocks"]

    # The TTL passing is what is under test: the pins go once it has, not before.
    for actor, before in ((pins.os_a, os0), (pins.fs, fs0)):
        wait_until(
            lambda: _figures(actor)["pinned_blocks"] == before["pinned_blocks"],  # noqa: B023
            timeout_s=SHORT_TTL_S + 30,
            interval_s=0.25,
            what="the short pin to expire",
        )
        assert time.monotonic() - t0 >= SHORT_TTL_S, "a pin expired before its TTL"
    assert all(_held(pins.os_a, e_keys)) and all(_held(pins.fs, e_keys)), "expiry alone must not evict"

    # The next eviction pass takes the expired blocks first (the oldest by last use), nothing else:
    # in the object store their pack goes whole at the first store that evicts anything.
    stores = 0
    while any(_held(pins.os_a, e_keys)) or any(_held(pins.fs, e_keys)):
        assert stores < TIER_BLOCKS, "the expired blocks stayed"
        held = {"object store": _keys(pins.os_a), "fs root": _keys(pins.fs)}
        _store(pins, pins.prompt(SHORT))
        stores += 1
        for name, actor in (("object store", pins.os_a), ("fs root", pins.fs)):
            gone = held[name] - _keys(actor)
            assert gone <= set(e_keys), (
                f"{name}: evicted {len(gone - set(e_keys))} newer blocks before the expired ones"
            )
        gone_os = held["object store"] - _keys(pins.os_a)
        assert not gone_os or gone_os == set(e_keys), "the object store evicted part of a pack"
    print(f"the expired blocks went at store {stores} after their TTL")


def test_pins_past_the_tenant_quota_and_the_tier_cap_are_refused_and_counted(pins) -> None:
    # The tenant's pins may take max_pinned_fraction of its quota: 2 of its 3 blocks.
    size = _file_size(pins)
    os0, fs0 = _figures(pins.os_a), _figures(pins.fs)
    frac = os0["max_pinned_fraction"]
    assert frac == 0.5 and os0["tenant_quotas"] == {TENANT: TENANT_QUOTA_BLOCKS * CHUNK}, os0
    tokens = pins.prompt(SHORT)
    n = _full(tokens)
    assert os0["pinned_bytes"] + n * CHUNK <= frac * os0["capacity_bytes"], "the tier cap would refuse first"
    assert n * CHUNK > frac * TENANT_QUOTA_BLOCKS * CHUNK
    want_fs = _predict_files(n, size, fs0, TENANT, TENANT_QUOTA_BLOCKS * FILE_EST)
    assert want_fs["tenant_quota"] > 0 and want_fs["tier_cap"] == 0, want_fs
    params = {"tenant": TENANT, "cache_ttl_s": LONG_TTL_S}
    t_keys = _store(pins, tokens, params)  # served, and cached (unpinned)
    os1, fs1 = _figures(pins.os_a), _figures(pins.fs)
    assert _counter(os1, "pins_refused_tenant_quota") - _counter(os0, "pins_refused_tenant_quota") == n  # a pack whole
    assert _counter(os1, "pins_refused_tier_cap") == _counter(os0, "pins_refused_tier_cap")
    assert os1["pinned_blocks"] == os0["pinned_blocks"] and TENANT not in os1["tenant_pinned_bytes"], os1
    assert os1["tenant_bytes"].get(TENANT) == n * CHUNK, os1["tenant_bytes"]
    refused_fs = _counter(fs1, "pins_refused_tenant_quota") - _counter(fs0, "pins_refused_tenant_quota")
    assert refused_fs == want_fs["tenant_quota"], (refused_fs, want_fs)
    assert (
        fs1["tenant_pinned_bytes"].get(TENANT, 0) == want_fs["pinned"] * size <= frac * TENANT_QUOTA_BLOCKS * FILE_EST
    )
    assert fs1["pinned_blocks"] - fs0["pinned_blocks"] == want_fs["pinned"]
    assert all(_held(pins.os_a, t_keys)) and all(_held(pins.fs, t_keys))
    again = ray.get(pins.b.generate.remote(tokens, kv_transfer_params=params, settle=True), timeout=600)
    assert again.cached_tokens == n * BLOCK_TOKENS, "the tenant's refused pin left its blocks uncached"

    # The tier's pins may take max_pinned_fraction of its capacity: pin long prompts until one is refused.
    refused = False
    for _ in range(4):
        os0, fs0 = _figures(pins.os_a), _figures(pins.fs)
        n = LONG // BLOCK_TOKENS
        over = os0["pinned_bytes"] + n * CHUNK > frac * os0["capacity_bytes"]
        want_fs = _predict_files(n, size, fs0)
        keys = _store(pins, pins.prompt(), {"cache_ttl_s": LONG_TTL_S})
        os1, fs1 = _figures(pins.os_a), _figures(pins.fs)
        assert _counter(os1, "pins_refused_tier_cap") - _counter(os0, "pins_refused_tier_cap") == (n if over else 0)
        assert os1["pinned_blocks"] - os0["pinned_blocks"] == (0 if over else n)
        assert os1["pinned_bytes"] <= frac * os1["capacity_bytes"], os1
        assert _counter(fs1, "pins_refused_tier_cap") - _counter(fs0, "pins_refused_tier_cap") == want_fs["tier_cap"]
        assert fs1["pinned_blocks"] - fs0["pinned_blocks"] == want_fs["pinned"], (want_fs, fs1)
        assert fs1["pinned_bytes"] <= frac * fs1["capacity_bytes"], fs1
        assert all(_held(pins.os_a, keys)) and all(_held(pins.fs, keys)), "a refused pin's blocks were not cached"
        if over:
            refused = want_fs["tier_cap"] > 0
            break
    assert refused, "no pin reached the tier cap in the object store and the fs root"


def test_invalidating_the_model_removes_its_pinned_blocks(pins) -> None:
    tokens = pins.prompt(SHORT)
    i_keys = _store(pins, tokens, {"cache_ttl_s": LONG_TTL_S})
    tiers = {"worker object store": pins.os_a, "head object store": pins.os_b, "fs": pins.fs}
    before = {name: _figures(actor) for name, actor in tiers.items()}
    assert before["worker object store"]["pinned_blocks"] > 0 and before["fs"]["pinned_blocks"] > 0, before
    out = pins.services.invalidate(pins.model)
    assert out.identities and not out.errors, out
    assert out.blocks_dropped >= sum(f.get("blocks", f.get("files", 0)) for f in before.values()), out
    for name, actor in tiers.items():
        after = _figures(actor)
        assert after["pinned_blocks"] == 0 and after["pinned_bytes"] == 0, (name, after)
        assert after["tenant_pinned_bytes"] == {} and after["pin_expiries"] == [], (name, after)
        assert not _keys(actor), f"the {name} still holds blocks of the invalidated model"
    assert not any(pins.services.directory.lookup(i_keys, timeout=30)), "the directory still lists them"
    fresh = ray.get(pins.b.generate.remote(tokens, settle=True), timeout=600)
    assert fresh.cached_tokens == 0, "an invalidated pinned block was served"


def test_a_pin_on_a_dead_node_leaves_with_it_and_the_pinned_fs_copy_serves(pins) -> None:
    """Last: it removes the worker node (replica A and its object store go with it)."""
    fs0 = _figures(pins.fs)
    tokens = pins.prompt()
    n = _full(tokens)
    on_a, d_keys = _send(pins, tokens, {"cache_ttl_s": LONG_TTL_S})
    assert _figures(pins.os_a)["pinned_blocks"] == n
    assert _figures(pins.fs)["pinned_blocks"] - fs0["pinned_blocks"] == n
    os_holder = f"object_store:{pins.worker}"
    listed = pins.services.directory.lookup(d_keys, timeout=30)
    assert all(os_holder in {h.holder_id for h in hs} for hs in listed), listed

    (worker_node,) = pins.cluster.worker_nodes
    pins.cluster.remove_node(worker_node)

    def holders_once_gone() -> list[set[str]]:
        found = [{h.holder_id for h in hs} for hs in pins.services.directory.lookup(d_keys, timeout=30)]
        return [] if any(os_holder in ids for ids in found) else found

    left = wait_until(
        holders_once_gone,
        timeout_s=60,
        what="the dead node's object store to leave the directory",
    )
    assert all(any(h.startswith("fs:") for h in hs) for hs in left), left
    assert _figures(pins.fs)["pinned_blocks"] - fs0["pinned_blocks"] == n, "the fs copy lost its pin"
    on_b = ray.get(pins.b.generate.remote(tokens, settle=True), timeout=600)
    assert on_b.cached_tokens == n * BLOCK_TOKENS, "the pinned fs copy did not serve the surviving replica"
    assert on_b.token_ids == on_a.token_ids and on_b.top_logprobs == on_a.top_logprobs
