"""End to end on vLLM's CPU backend: RaykvOffloadingSpec offloads a prompt's KV,
the engine evicts it, and a re-sent prompt is served from the CPU primary tier
(or from vLLM's `fs` secondary tier) with the same first-token logprobs."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import kv_transfer_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

PROMPT_LEN = 1001  # 7 full 128-token blocks (896 tokens) are cacheable
CACHEABLE = (PROMPT_LEN // 128) * 128
ENGINE_BLOCKS = 20  # 2560 tokens: three other prompts evict the first one
CHUNK_BYTES = 128 << 10  # one 128-token block of the tiny model (2 layers)


def _counters(llm: Any) -> dict[str, float]:
    """Prefix-cache counters, with `..._by_source` split per source label."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            out[f"source:{m.labels['source']}"] = m.value
        elif m.name in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits"):
            out[m.name.removeprefix("vllm:")] = m.value
    return out


def _generate(llm: Any, seed: int) -> tuple[Any, float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompt = {"prompt_token_ids": make_prompt_tokens(PROMPT_LEN, seed)}
    start = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out, time.perf_counter() - start  # 1 output token: ~TTFT


@pytest.fixture(scope="module", params=["cpu", "fs"])
def offload_llm(request, vllm_env, tiny_model, tmp_path_factory) -> Iterator[tuple[str, Any, Path]]:
    from vllm import LLM

    fs_root = tmp_path_factory.mktemp("fs-tier")
    if request.param == "fs":
        # Primary holds 16 chunks, fewer than the 4 prompts' 28: the first
        # prompt must come back from the fs tier.
        cfg = kv_transfer_config(
            [{"type": "fs", "root_dir": str(fs_root), "n_read_threads": 2, "n_write_threads": 2}],
            cpu_bytes=16 * CHUNK_BYTES,
        )
    else:
        cfg = kv_transfer_config([], cpu_bytes=512 * CHUNK_BYTES)
    start = time.perf_counter()
    llm = LLM(
        model=tiny_model,
        max_model_len=2048,
        num_gpu_blocks_override=ENGINE_BLOCKS,
        enforce_eager=True,  # skips ~40 s of torch.compile on a fresh machine
        disable_log_stats=False,  # get_metrics() needs the stat loggers
        kv_transfer_config=cfg,
    )
    print(f"\n[{request.param}] LLM load {time.perf_counter() - start:.1f}s")
    yield request.param, llm, fs_root
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def test_evicted_prompt_is_served_from_offload(offload_llm) -> None:
    kind, llm, fs_root = offload_llm
    _generate(llm, seed=100)  # first request pays one-off kernel set-up
    cold, cold_s = _generate(llm, seed=0)
    assert cold.num_cached_tokens == 0
    for seed in (1, 2, 3):  # push prompt 0 out of the engine's own cache
        _generate(llm, seed)

    before = _counters(llm)
    warm, warm_s = _generate(llm, seed=0)
    after = _counters(llm)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    print(f"[{kind}] TTFT cold {cold_s * 1e3:.0f} ms, from offload {warm_s * 1e3:.0f} ms; {delta}")

    assert warm.num_cached_tokens == CACHEABLE
    assert delta["prefix_cache_hits"] == 0  # not the engine's own cache ...
    assert delta["external_prefix_cache_hits"] == CACHEABLE  # ... but the connector
    source = "disk" if kind == "fs" else "host"
    if any(k.startswith("source:") for k in after):  # vLLM >= 0.32 counts hits per source
        assert delta[f"source:{source}"] == CACHEABLE
    if kind == "fs":
        assert list(fs_root.rglob("*.bin")), "fs tier wrote no block files"

    cold_lp, warm_lp = cold.outputs[0].logprobs[0], warm.outputs[0].logprobs[0]
    assert list(cold_lp) == list(warm_lp)  # same top-5 tokens, same order
    diff = max(abs(lp.logprob - warm_lp[t].logprob) for t, lp in cold_lp.items())
    print(f"[{kind}] max |logprob diff| over top-5: {diff:g}")
    # Loaded KV is bit-identical to what the cold prefill wrote, and the CPU
    # attention kernels give the same logits either way: exact equality.
    assert {t: lp.logprob for t, lp in cold_lp.items()} == {t: lp.logprob for t, lp in warm_lp.items()}
