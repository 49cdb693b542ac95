"""Blocks vLLM's cascade never offered to raykv because the CPU primary was full.

A real vLLM engine (CPU backend, EngineCore in its own process joined to the
test's Ray) with raykv's object store tier and a CPU primary of 4 chunks: a
prompt of 2 full blocks fits and reaches the tier; one of 15 full blocks does
not fit, so the primary refuses its stores and raykv counts the blocks
dropped. Every full block ends up either stored in raykv's tier or counted.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import raykv_kv_transfer_config
from tests.waiting import WaitTimeout, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

NAMESPACE = "raykv-vllm-drops-test"
CHUNK_BYTES = 128 << 10  # one 128-token block of the tiny model
PRIMARY_CHUNKS = 4


@pytest.fixture(scope="module")
def small_primary_llm(ray_local, vllm_env, tiny_model) -> Iterator[Any]:
    from vllm import LLM

    import raykv

    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 1})
    llm = LLM(
        model=tiny_model,
        max_model_len=2048,
        num_gpu_blocks_override=20,
        max_num_batched_tokens=2048,  # a prompt's blocks are offered to the primary in one step
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=raykv_kv_transfer_config(
            {"namespace": NAMESPACE, "tiers": [{"type": "object_store", "capacity_bytes": 64 << 20}]},
            cpu_bytes=PRIMARY_CHUNKS * CHUNK_BYTES,
        ),
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    services.shutdown()
    if old is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = old


def _generate(llm: Any, tokens: list[int]) -> Any:
    from vllm import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1), use_tqdm=False)
    return out


def _counts(llm: Any) -> tuple[int, int]:
    """(blocks dropped before the cascade, blocks stored into raykv's tier), from vLLM's metrics.
    A request of no full block first: the engine hands its stats over with a step's outputs."""
    _generate(llm, make_prompt_tokens(20, 999))
    metrics = llm.get_metrics()
    dropped = sum(m.value for m in metrics if m.name == "vllm:raykv_cascade_dropped_blocks")
    stored = sum(m.value for m in metrics if m.name == "vllm:raykv_blocks_stored")
    return int(dropped), int(stored)


def _wait_counts(llm: Any, done: Any, timeout: float = 30.0) -> tuple[int, int]:
    """(dropped, stored) once ``done(dropped, stored)`` holds."""
    counts = (0, 0)

    def reached() -> bool:
        nonlocal counts
        counts = _counts(llm)
        return done(*counts)

    try:
        wait_until(reached, timeout_s=timeout, interval_s=0.2, what="the engine's (dropped, stored) block counts")
    except WaitTimeout as e:
        raise AssertionError(f"{e}; (dropped, stored) = {counts}") from None
    return counts


def test_full_primary_drops_are_counted(small_primary_llm) -> None:
    llm = small_primary_llm
    # 2 full blocks: they fit in the primary and reach the tier, nothing dropped
    _generate(llm, make_prompt_tokens(300, 1))
    dropped, stored = _wait_counts(llm, lambda d, s: s >= 2)
    assert (dropped, stored) == (0, 2)

    # 15 full blocks offered at once to a primary of 4 chunks: refused, then dropped
    _generate(llm, make_prompt_tokens(2001, 2))
    dropped, stored = _wait_counts(llm, lambda d, s: d + s >= 2 + 15)
    print(f"15-block prompt, primary of {PRIMARY_CHUNKS} chunks: {dropped} dropped, {stored - 2} stored")
    assert dropped > 0
    assert dropped + stored == 2 + 15, "every full block is either in raykv's tier or counted as dropped"

    # and raykv's own Ray metric, by the engine's node and raykv namespace
    from raykv.metrics.scrape import scrape_cluster

    def ray_metric() -> float:
        return sum(
            v
            for n, labels, v in scrape_cluster()
            if n == "ray_raykv_cascade_dropped_blocks_total" and labels.get("namespace") == NAMESPACE
        )

    wait_until(
        lambda: ray_metric() >= dropped,
        timeout_s=30,
        interval_s=1,
        what=f"Ray's dropped-blocks metric to reach {dropped}",
    )
    assert ray_metric() == dropped
