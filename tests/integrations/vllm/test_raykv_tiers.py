"""Real vLLM (CPU backend) with raykv's tiers as its secondary tiers.

The engine's own cache and the CPU primary are both too small for the
workload, so a re-sent prompt can only come back from the raykv tier. vLLM's
EngineCore runs in its own (spawned) process, which joins the test's Ray
through ``RAY_ADDRESS``, as an engine under Ray Serve does.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from raykv.core import naming
from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import raykv_kv_transfer_config
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

NAMESPACE = "raykv-vllm-test"
PROMPT_LEN = 1001
CACHEABLE = (PROMPT_LEN // 128) * 128  # 7 full 128-token blocks
ENGINE_BLOCKS = 20
CHUNK_BYTES = 128 << 10  # one 128-token block of the tiny model
PRIMARY_CHUNKS = 16  # fewer than the 28 chunks of 4 prompts


def _generate(llm: Any, tokens: list[int], params: dict | None = None) -> tuple[Any, float]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, extra_args=params)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)
    return out, time.perf_counter() - start


def _hits_by_source(llm: Any) -> dict[str, float]:
    """Prompt tokens served per cache source (vLLM >= 0.32), or, on vLLM 0.29
    (no per-source counter), the connector's hits under ``external``."""
    metrics = llm.get_metrics()
    by_source = {m.labels["source"]: m.value for m in metrics if m.name == "vllm:prompt_tokens_cached_by_source"}
    if by_source or any(m.name == "vllm:prompt_tokens_cached_by_source" for m in metrics):
        return by_source
    return {"external": sum(m.value for m in metrics if m.name == "vllm:external_prefix_cache_hits")}


@pytest.fixture(scope="module")
def ray_for_vllm(ray_local) -> Iterator[None]:
    """The module's Ray, reachable from vLLM's spawned EngineCore process."""
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield
    if old is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = old


@pytest.fixture(scope="module", params=["object_store", "fs"])
def raykv_llm(request, vllm_env, tiny_model, ray_for_vllm, tmp_path_factory) -> Iterator[tuple[str, Any, Any]]:
    """(tier type, LLM, the tier's holder actor)."""
    from vllm import LLM

    import raykv

    kind = request.param
    root = tmp_path_factory.mktemp("raykv-fs")
    tier = {"type": "fs", "root": str(root)} if kind == "fs" else {"type": "object_store", "capacity_bytes": 64 << 20}
    raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
    llm = LLM(
        model=tiny_model,
        max_model_len=2048,
        num_gpu_blocks_override=ENGINE_BLOCKS,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=raykv_kv_transfer_config(
            {"namespace": NAMESPACE, "tiers": [tier]}, cpu_bytes=PRIMARY_CHUNKS * CHUNK_BYTES
        ),
    )
    if kind == "fs":
        actor = ray.get_actor(naming.fs_actor(str(root)), namespace=NAMESPACE)
    else:
        actor = ray.get_actor(naming.object_store_actor(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)
    yield kind, llm, actor
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    raykv.attach(NAMESPACE).shutdown()  # the running services (a test restarts them)


def _holds(kind: str, actor: Any, blocks: int) -> bool:
    """The tier holds ``blocks`` blocks and has answered every store it was sent: an
    object-store key is held before its directory registration, and the engine's
    primary may evict a chunk only once the answer reached it (a primary still
    waiting for answers refuses the next prompt's chunks: "cannot store chunks")."""
    if len(ray.get(actor.keys.remote())) < blocks:
        return False
    if kind != "object_store":
        return True  # the fs actor's keys are its committed files
    counters = ray.get(actor.stats.remote()).figures["counters"]
    # (a counter appears at its first count: keys can be held before the first answer went out)
    return bool(counters.get("stores_answered", 0) == counters.get("store_calls", 0))


def _compute_then_evict(kind: str, llm: Any, actor: Any, seed: int, held: int = 0) -> tuple[list[int], Any, float, Any]:
    """Compute prompt ``seed``, then three others (seeds + 1..3) that evict it from the
    engine cache and the primary, each once its blocks are in the tier (which held
    ``held`` blocks before); returns the first prompt, its cold output and TTFT, and
    its output served from the engine's own prefix cache (asked again at once)."""
    prompt = make_prompt_tokens(PROMPT_LEN, seed)
    cold, cold_s = _generate(llm, prompt)
    assert cold.num_cached_tokens == 0
    cached, _ = _generate(llm, prompt)
    assert cached.num_cached_tokens == CACHEABLE
    # Each prompt's 7 blocks reach the tier (their cascade done, so the primary may
    # evict them) before the next prompt needs room: else the primary keeps chunks
    # of prompt 0 that were still pinned and evicts others (seen on vLLM 0.29).
    wait_until(lambda: _holds(kind, actor, held + 7), timeout_s=20.0, what=f"the {kind} tier to hold the prompt")
    for i in (1, 2, 3):
        _generate(llm, make_prompt_tokens(PROMPT_LEN, seed + i))
        wait_until(
            lambda n=held + 7 * (1 + i): _holds(kind, actor, n),
            timeout_s=20.0,
            what=f"the {kind} tier to hold {1 + i} prompts",
        )
    return prompt, cold, cold_s, cached


def _assert_same_output(cold: Any, cached: Any, loaded: Any) -> None:
    """A prompt whose prefix raykv loaded answers bit for bit as when the engine's own
    prefix cache held it: the same KV bytes, then the same computation of the rest. The
    cold output, which computed the whole prompt in one pass, can differ in the last
    bits (vLLM's CPU backend, without raykv: 2.4e-6 on one of four prompts on an AMD
    EPYC host, none on others), so it is compared within 1e-4."""
    cold_lp, cached_lp, loaded_lp = (o.outputs[0].logprobs[0] for o in (cold, cached, loaded))
    assert list(cached_lp) == list(loaded_lp) == list(cold_lp)
    assert {t: lp.logprob for t, lp in cached_lp.items()} == {t: lp.logprob for t, lp in loaded_lp.items()}
    for token, lp in cold_lp.items():
        assert loaded_lp[token].logprob == pytest.approx(lp.logprob, abs=1e-4), token


def test_evicted_prompt_is_served_from_the_raykv_tier(raykv_llm) -> None:
    kind, llm, actor = raykv_llm
    _generate(llm, make_prompt_tokens(PROMPT_LEN, 100))  # one-off kernel set-up
    prompt, cold, cold_s, cached = _compute_then_evict(kind, llm, actor, 0, held=7)  # (100's blocks: 7)

    loads_before = ray.get(actor.stats.remote()).figures
    before = _hits_by_source(llm)
    warm, warm_s = _generate(llm, prompt)
    after = _hits_by_source(llm)
    loads_after = ray.get(actor.stats.remote()).figures
    print(f"[{kind}] TTFT cold {cold_s * 1e3:.0f} ms, from raykv {warm_s * 1e3:.0f} ms; hits {after}")

    assert warm.num_cached_tokens == CACHEABLE
    source = ("disk" if kind == "fs" else "host") if "external" not in after else "external"
    assert after.get(source, 0) - before.get(source, 0) == CACHEABLE
    if kind == "object_store":  # the node actor copied the blocks into the primary
        assert loads_after["hits"] - loads_before["hits"] >= 1
    # vLLM's own metrics show the raykv tier's hits: its tiering manager's
    # per-tier chunk hits, and the vllm:raykv_* series raykv reports through
    # get_stats (declared by build_metric_definitions)
    series = [(m.name, dict(m.labels), m.value) for m in llm.get_metrics() if hasattr(m, "value")]
    tier_hits = [
        v
        for n, labels, v in series
        if n.startswith("vllm:kv_offload_tiering_")
        and n.endswith("_hits")
        and "raykv" in labels.get("tier", "").lower()
    ]
    assert tier_hits and sum(tier_hits) >= CACHEABLE // 128, [s for s in series if "tiering" in s[0]]
    raykv_hits = [v for n, _, v in series if n == "vllm:raykv_lookup_hits"]
    raykv_loaded = [v for n, _, v in series if n == "vllm:raykv_blocks_loaded"]
    assert sum(raykv_hits) >= CACHEABLE // 128 and sum(raykv_loaded) >= CACHEABLE // 128, [
        s for s in series if "raykv" in s[0]
    ]
    _assert_same_output(cold, cached, warm)


def test_request_level_rule_cascades_prefix_hits(raykv_llm) -> None:
    """A REQUEST_LEVEL rule sends a request's prefix-hit blocks to the tier too."""
    import raykv

    kind, llm, actor = raykv_llm
    if kind != "fs":
        pytest.skip("one tier is enough to show the policy")
    services = raykv.attach(NAMESPACE)
    version = services.add_rule({"name": "persist", "tier": "fs", "match": {"kv_transfer_params": {"persist": True}}})
    # The engine process's policy cache long-polls the control actor: it has
    # the rule once its long poll waits at the new version.
    wait_until(
        lambda: max(ray.get(services.control.rules_readers.remote()), default=-1) >= version,
        timeout_s=20.0,
        what="the engine's policy cache to hold the rule",
    )
    prefix = make_prompt_tokens(PROMPT_LEN, 40)
    held = set(ray.get(actor.keys.remote()))
    _generate(llm, prefix)
    wait_until(
        lambda: len(set(ray.get(actor.keys.remote())) - held) >= 7, timeout_s=20.0, what="the prefix's blocks in fs"
    )
    prefix_keys = set(ray.get(actor.keys.remote())) - held
    ray.get(actor.remove.remote(list(prefix_keys)))  # the tier loses them; the engine keeps them

    def held_prefix() -> int:
        return len(prefix_keys & set(ray.get(actor.keys.remote())))

    before = set(ray.get(actor.keys.remote()))
    plain, _ = _generate(llm, prefix + make_prompt_tokens(200, 41))  # CHUNK_LEVEL
    assert plain.num_cached_tokens == CACHEABLE  # a prefix hit in the engine
    # Its 2 new full blocks land in the tier in the job that would also carry
    # the prefix's blocks at REQUEST_LEVEL.
    wait_until(
        lambda: len(set(ray.get(actor.keys.remote())) - before - prefix_keys) >= 2,
        timeout_s=20.0,
        what="the cascade of the request's new blocks",
    )
    assert held_prefix() == 0, "CHUNK_LEVEL re-stored prefix-hit blocks"

    persisted, _ = _generate(llm, prefix + make_prompt_tokens(200, 42), {"kv_transfer_params": {"persist": True}})
    assert persisted.num_cached_tokens == CACHEABLE
    wait_until(
        lambda: held_prefix() == len(prefix_keys), timeout_s=20.0, what="REQUEST_LEVEL cascade of the prefix hits"
    )
    services.remove_rule("persist")
    assert version > 0


#: kv_transfer_params a client may send (vLLM itself needs a dict when the value is truthy):
#: falsy values, nested values, wrong types for the keys raykv and vLLM read.
ODD_KV_TRANSFER_PARAMS: list[Any] = [
    None,
    {},
    [],
    0,
    "",
    False,
    {"persist": None},
    {"persist": "yes"},
    {"persist": [True, {"a": None}]},
    {"persist": {"a": {"b": [1, 2.5, None]}}},
    {"persist": float("nan")},
    {"tenant": 7},
    {"tenant": {"x": [1]}},
    {"tenant": ""},
    {"max_load_tokens": "all", "kv_load_tiers": "fs"},
    {"": {"": []}},
    {"persist": True, "tenant": ["a"]},  # matches the REQUEST_LEVEL rule; an odd tenant
]


def test_odd_kv_transfer_params_succeed_and_equal_recompute(raykv_llm) -> None:
    """Each odd value on a real request: computed once, then (evicted from the engine
    and the primary) served again through raykv: the request succeeds and its
    first-token logprobs equal the computed ones (1e-4: vLLM's CPU backend)."""
    import raykv

    kind, llm, actor = raykv_llm
    if kind != "fs":
        pytest.skip("one tier is enough for the request path")
    services = raykv.attach(NAMESPACE)
    services.add_rule({"name": "odd-persist", "tier": "fs", "match": {"kv_transfer_params": {"persist": True}}})
    version = services.add_rule({"name": "odd-tenant", "tier": "*", "match": {"tenant": "7"}})
    try:
        # The engine's policy cache long-polls the new rules: it holds them once
        # its long poll waits at the new version.
        wait_until(
            lambda: max(ray.get(services.control.rules_readers.remote()), default=-1) >= version,
            timeout_s=20.0,
            what="the engine's policy cache to hold the odd-* rules",
        )
        prompts = [make_prompt_tokens(PROMPT_LEN, 60 + i) for i in range(len(ODD_KV_TRANSFER_PARAMS))]
        held = len(ray.get(actor.keys.remote()))
        computed = []
        for i, (tokens, params) in enumerate(zip(prompts, ODD_KV_TRANSFER_PARAMS)):
            out, _ = _generate(llm, tokens, {"kv_transfer_params": params})
            assert out.num_cached_tokens == 0 and len(out.outputs[0].token_ids) == 1, params
            computed.append(out)
            # the primary (16 chunks) is smaller than the traffic: let each prompt cascade before the next
            want = held + 7 * (i + 1)
            wait_until(
                lambda: len(ray.get(actor.keys.remote())) >= want,
                timeout_s=20.0,
                what=f"prompt {i}'s blocks in the fs tier",
            )

        before = _hits_by_source(llm)
        for tokens, params, cold in zip(prompts, ODD_KV_TRANSFER_PARAMS, computed):
            warm, _ = _generate(llm, tokens, {"kv_transfer_params": params})
            assert warm.num_cached_tokens == CACHEABLE, (params, warm.num_cached_tokens)
            assert warm.outputs[0].token_ids == cold.outputs[0].token_ids, params
            cold_lp, warm_lp = cold.outputs[0].logprobs[0], warm.outputs[0].logprobs[0]
            assert set(cold_lp) == set(warm_lp), params
            for token, lp in cold_lp.items():
                assert warm_lp[token].logprob == pytest.approx(lp.logprob, abs=1e-4), (params, token)
        source = "external" if "external" in before else "disk"  # vLLM 0.29: no per-source counter
        from_raykv = _hits_by_source(llm).get(source, 0) - before.get(source, 0)
        # the engine cache (20 blocks) and the primary (16 chunks) hold ~3 prompts: the rest came from raykv
        assert from_raykv >= CACHEABLE * (len(prompts) - 4), (from_raykv, before)
    finally:
        services.remove_rule("odd-persist")
        services.remove_rule("odd-tenant")


def _tier_actor_name(kind: str) -> str | None:
    """The name of the test's live tier actor (the module's one fs root, or this node's object store)."""
    if kind == "object_store":
        return naming.object_store_actor(ray.get_runtime_context().get_node_id())
    prefix = naming.fs_actor("")[: -len(naming.root_digest(""))]
    named = ray.util.list_named_actors(all_namespaces=True)
    return next((e["name"] for e in named if e["namespace"] == NAMESPACE and e["name"].startswith(prefix)), None)


def _live_actor(name: str | None) -> Any:
    """Actor ``name`` of the test's namespace once it answers, else None."""
    if name is None:
        return None
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
        ray.get(actor.raykv_ping.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - not started (yet), or the dead one's name
        return None
    return actor


def test_engine_attaches_again_after_raykv_is_stopped_and_started(raykv_llm) -> None:
    """``raykv stop`` while the engine runs: its requests still succeed (computed, their
    stores failing fast); ``raykv start`` again: the engine's tier attaches to the new
    services by itself, and an evicted prompt is served from the tier once more."""
    import raykv

    kind, llm, old_actor = raykv_llm
    name = _tier_actor_name(kind)
    assert name is not None
    raykv.attach(NAMESPACE).shutdown()  # what `raykv stop` does
    for seed in (80, 81):  # served all the same, computed
        out, _ = _generate(llm, make_prompt_tokens(PROMPT_LEN, seed))
        assert out.num_cached_tokens == 0 and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old_actor.keys.remote(), timeout=10)

    started = time.monotonic()
    raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
    # The engine's policy long poll notices within a second; its next steps build the
    # tier again, which starts the tier's actor. Requests meanwhile are computed.
    seeds = iter(range(200, 10_000))

    def storing() -> Any:
        """The new tier actor once the engine's stores reach it."""
        _generate(llm, make_prompt_tokens(PROMPT_LEN, next(seeds)))  # steps the engine; 7 blocks to store
        actor = _live_actor(name)
        return actor if actor is not None and ray.get(actor.keys.remote()) else None

    new_actor = wait_until(
        storing, timeout_s=60.0, interval_s=0.5, what=f"the engine's {kind} tier to store to the restarted raykv"
    )
    print(f"[{kind}] the engine stored to the restarted raykv {time.monotonic() - started:.1f} s after it started")
    wait_until(lambda: _holds(kind, new_actor, 7), timeout_s=20.0, what="the last prompt's stores to end")
    held = len(ray.get(new_actor.keys.remote()))
    prompt, cold, _, cached = _compute_then_evict(kind, llm, new_actor, 90, held=held)
    warm, _ = _generate(llm, prompt)
    assert warm.num_cached_tokens == CACHEABLE
    _assert_same_output(cold, cached, warm)
