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
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
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
    services.shutdown()


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


def test_evicted_prompt_is_served_from_the_raykv_tier(raykv_llm) -> None:
    kind, llm, actor = raykv_llm
    _generate(llm, make_prompt_tokens(PROMPT_LEN, 100))  # one-off kernel set-up
    prompt = make_prompt_tokens(PROMPT_LEN, 0)
    cold, cold_s = _generate(llm, prompt)
    assert cold.num_cached_tokens == 0
    # Each prompt's 7 blocks reach the tier (their cascade done, so the primary may
    # evict them) before the next prompt needs room: else the primary keeps chunks
    # of prompt 0 that were still pinned and evicts others (seen on vLLM 0.29).
    wait_until(lambda: _holds(kind, actor, 2 * 7), timeout_s=20.0, what=f"the {kind} tier to hold 2 prompts")
    for seed in (1, 2, 3):  # evict prompt 0 from the engine cache and the primary
        _generate(llm, make_prompt_tokens(PROMPT_LEN, seed))
        wait_until(
            lambda n=2 + seed: _holds(kind, actor, n * 7),
            timeout_s=20.0,
            what=f"the {kind} tier to hold {2 + seed} prompts",
        )

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
    cold_lp, warm_lp = cold.outputs[0].logprobs[0], warm.outputs[0].logprobs[0]
    assert list(cold_lp) == list(warm_lp)
    assert {t: lp.logprob for t, lp in cold_lp.items()} == {t: lp.logprob for t, lp in warm_lp.items()}


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
