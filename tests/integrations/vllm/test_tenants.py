"""Tenants on a real vLLM engine (CPU backend) with raykv's fs tier.

Tenants named only by ``kv_transfer_params["tenant"]`` share no block unless
the namespace's ``shared_tenants`` opts them in; a salted tenant's blocks are
charged to it (vLLM 0.32 hands tiers no salt: ``compat.carry_cache_salt``).

The engine's own cache and the CPU primary are too small for the workload,
so a re-sent prompt, after others, can only come back from the raykv tier. A
tenant label also salts the engine's own hashes, so tenants share nothing on
one engine either (``raykv.core.tenants.engine_salt``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from raykv.core import naming
from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import raykv_kv_transfer_config
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "raykv-vllm-tenants-test"
SHARED = {"team-cd": ["tenant-c", "tenant-d"]}
PROMPT_LEN = 1001
CACHEABLE = (PROMPT_LEN // 128) * 128  # 7 full 128-token blocks
ENGINE_BLOCKS = 20
CHUNK_BYTES = 128 << 10  # one 128-token block of the tiny model
PRIMARY_CHUNKS = 16  # fewer than the 21 chunks of 3 prompts


def _generate(llm: Any, tokens: list[int], tenant: object = None, **prompt: Any) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"tenant": tenant}} if tenant else None
    sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    (out,) = llm.generate([{"prompt_token_ids": tokens, **prompt}], sp, use_tqdm=False)
    return out


def _by_source(llm: Any) -> dict[str, float]:
    """Prompt tokens vLLM counted as served, per cache source (``device``, ``host``, ``disk``)."""
    return {m.labels["source"]: m.value for m in llm.get_metrics() if m.name == "vllm:prompt_tokens_cached_by_source"}


def _from_disk(llm: Any) -> float:
    """Prompt tokens vLLM counted as served from its storage tiers (raykv's fs tier here)."""
    return _by_source(llm).get("disk", 0)


@pytest.fixture(scope="module")
def engine(vllm_env, tiny_model, ray_local, tmp_path_factory) -> Iterator[dict[str, Any]]:
    from vllm import LLM

    import raykv

    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # the spawned EngineCore joins this Ray
    root = str(tmp_path_factory.mktemp("raykv-fs-tenants"))
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 1, "shared_tenants": SHARED})
    llm = LLM(
        model=tiny_model,
        max_model_len=2048,
        num_gpu_blocks_override=ENGINE_BLOCKS,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=raykv_kv_transfer_config(
            {"namespace": NAMESPACE, "tiers": [{"type": "fs", "root": root, "fsync": False}]},
            cpu_bytes=PRIMARY_CHUNKS * CHUNK_BYTES,
        ),
    )
    actor = ray.get_actor(naming.fs_actor(root), namespace=NAMESPACE)
    _generate(llm, make_prompt_tokens(PROMPT_LEN, 300))  # one-off kernel set-up
    yield {"llm": llm, "actor": actor, "seed": iter(range(301, 400))}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    services.shutdown()
    if old is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = old


def _evict(engine: dict[str, Any]) -> None:
    """Push earlier prompts out of the engine's cache and the CPU primary, each one
    stored in the fs tier before the next (back to back, a slow host's primary can
    still be writing the last prompt's chunks and refuse the next: "cannot store")."""
    for _ in range(3):
        _stored(engine, make_prompt_tokens(PROMPT_LEN, next(engine["seed"])))


def _stored(engine: dict[str, Any], tokens: list[int], tenant: object = None, **prompt: Any) -> Any:
    """Send ``tokens`` (cold: nothing cached) and wait until its 7 blocks are in the fs tier."""
    actor = engine["actor"]
    held = len(ray.get(actor.keys.remote()))
    out = _generate(engine["llm"], tokens, tenant, **prompt)
    wait_until(
        lambda: len(ray.get(actor.keys.remote())) >= held + 7, timeout_s=30.0, what="the prompt's blocks in the fs tier"
    )
    return out


def test_tenants_share_no_block_unless_the_namespace_opts_in(engine) -> None:
    llm = engine["llm"]
    prompt = make_prompt_tokens(PROMPT_LEN, 0)
    assert _stored(engine, prompt, "tenant-a").num_cached_tokens == 0
    # Right away, with tenant-a's blocks in the engine's cache and the CPU primary:
    # the label salts the engine's hashes (compat.salt_tenant_requests), so no cache serves them.
    # (tenant-f here: the blocks it computes go to raykv's tier, in its own scope)
    sources = _by_source(llm)
    other = _generate(llm, prompt, "tenant-f")
    assert other.num_cached_tokens == 0 and _by_source(llm) == sources, (sources, _by_source(llm))
    assert _generate(llm, prompt, "tenant-a").num_cached_tokens == CACHEABLE  # its own: from the engine
    _evict(engine)
    before, sources = _from_disk(llm), _by_source(llm)
    other = _generate(llm, prompt, "tenant-b")  # only raykv's tier holds them now: recomputed still
    assert other.num_cached_tokens == 0 and _from_disk(llm) == before, (sources, _by_source(llm))
    _evict(engine)
    again = _generate(llm, prompt, "tenant-a")  # tenant-a's own blocks come back from raykv
    assert again.num_cached_tokens == CACHEABLE and _from_disk(llm) - before == CACHEABLE

    shared = make_prompt_tokens(PROMPT_LEN, 1)
    assert _stored(engine, shared, "tenant-c").num_cached_tokens == 0
    assert _generate(llm, shared, "tenant-d").num_cached_tokens == CACHEABLE  # opted in: the engine's cache too
    _evict(engine)
    before = _from_disk(llm)
    peer = _generate(llm, shared, "tenant-d")  # opted in with tenant-c: its blocks are served
    assert peer.num_cached_tokens == CACHEABLE and _from_disk(llm) - before == CACHEABLE


def test_a_tenant_that_is_not_a_str_shares_no_block_with_requests_that_name_none(engine) -> None:
    """A client that sends its tenant as a list or a dict still keeps its requests apart
    (``raykv.core.validate.request_tenant_value``): before, raykv dropped such a tenant with
    a warning, and the request shared every cache with the requests that name no tenant."""
    llm = engine["llm"]
    prompt = make_prompt_tokens(PROMPT_LEN, 5)
    assert _stored(engine, prompt).num_cached_tokens == 0  # no tenant: plain keys
    sources = _by_source(llm)
    odd = _generate(llm, prompt, ["tenant-a"])  # right away: the engine's cache holds the plain blocks
    assert odd.num_cached_tokens == 0 and _by_source(llm) == sources, (sources, _by_source(llm))
    assert _generate(llm, prompt, ["tenant-a"]).num_cached_tokens == CACHEABLE  # the same value: its own
    _evict(engine)
    before = _from_disk(llm)
    odd = _generate(llm, prompt, {"team": "a"})  # only raykv's tier holds the plain blocks now
    assert odd.num_cached_tokens == 0 and _from_disk(llm) == before, (before, _by_source(llm))
    plain = _generate(llm, prompt)  # they are still there, for the requests that name no tenant
    assert plain.num_cached_tokens == CACHEABLE and _from_disk(llm) - before == CACHEABLE


def test_a_client_salt_cannot_name_a_tenant(engine) -> None:
    """A client that sends, as its ``cache_salt``, the salt raykv gives tenant-a's
    requests gets its own blocks, not tenant-a's (``raykv.core.tenants.engine_salt``)."""
    from raykv.core.tenants import ISOLATED, engine_salt

    llm = engine["llm"]
    prompt = make_prompt_tokens(PROMPT_LEN, 4)
    assert _stored(engine, prompt, "tenant-a").num_cached_tokens == 0
    forged = engine_salt(None, ISOLATED.scope_of_tenant("tenant-a"))
    assert _stored(engine, prompt, cache_salt=forged).num_cached_tokens == 0  # stored: the next test counts bytes
    assert _generate(llm, prompt, "tenant-a").num_cached_tokens == CACHEABLE


def test_salted_and_labelled_tenants_are_charged_their_bytes(engine) -> None:
    actor = engine["actor"]
    _stored(engine, make_prompt_tokens(PROMPT_LEN, 2), cache_salt="salty")
    _stored(engine, make_prompt_tokens(PROMPT_LEN, 3), "tenant-e")
    held = ray.get(actor.stats.remote()).figures["tenant_bytes"]
    assert held.get("salty", 0) >= 7 * CHUNK_BYTES, sorted(held.items())  # not the default tenant's
    assert held.get("tenant-e", 0) >= 7 * CHUNK_BYTES, held
