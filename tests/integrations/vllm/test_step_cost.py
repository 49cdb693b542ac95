"""raykv's cost on a real vLLM engine's scheduler thread, read back after traffic
(issue 21: per-step and per-request cost metrics; the RETRY budget).

vLLM (CPU backend) runs raykv's object_store tier; the test sends prompts, some
again after the engine cache lost them, and reads the ``vllm:raykv_engine_*``
and ``vllm:raykv_request_retries`` series from ``LLM.get_metrics()``, as
``EngineReplica.raykv_step_cost`` does.
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
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

NAMESPACE = "raykv-step-cost-test"
PROMPT_LEN = 1001
ENGINE_BLOCKS = 20
CHUNK_BYTES = 128 << 10  # one 128-token block of the tiny model
PRIMARY_CHUNKS = 16
OUTPUT_TOKENS = 8
#: raykv's time per step that no healthy engine comes near, even on this 2-core host.
GENEROUS_STEP_S = 0.05

CONFIGS = {
    # the defaults: the node's view holds every key, so a lookup never waits for the directory
    "defaults": {"namespace": NAMESPACE},
    # views of asked keys only: a key the view does not know is asked, with the default
    # 5 ms lookup wait and 50 ms RETRY budget
    "asked_keys": {"namespace": NAMESPACE + "-asked", "agent_view_all_keys": False},
    # no wait and no RETRY budget: a request never gets RETRY, it computes instead
    "no_retry": {
        "namespace": NAMESPACE + "-no-retry",
        "agent_view_all_keys": False,
        "lookup_wait_ms": 0.0,
        "lookup_retry_budget_ms": 0.0,
    },
}


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


def _generate(llm: Any, tokens: list[int], max_tokens: int = OUTPUT_TOKENS) -> Any:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, vllm_env, tiny_model, ray_for_vllm) -> Iterator[tuple[str, dict[str, Any], dict[str, float]]]:
    """(config name, raykv's cost read after traffic, vLLM's raykv lookup counters)."""
    from vllm import LLM

    import raykv
    from raykv.integrations.vllm.stats import read_step_cost

    name = request.param
    config = CONFIGS[name]
    services = raykv.start({**config, "directory_shards": 2})
    if config.get("agent_view_all_keys", True):  # traffic once the node's view holds every key
        agent = services.directory_agent()
        wait_until(lambda: ray.get(agent.ready.remote(), timeout=30), timeout_s=60, what="a complete node view")
    llm = LLM(
        model=tiny_model,
        max_model_len=2048,
        num_gpu_blocks_override=ENGINE_BLOCKS,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=raykv_kv_transfer_config(
            {**config, "tiers": [{"type": "object_store", "capacity_bytes": 64 << 20}]},
            cpu_bytes=PRIMARY_CHUNKS * CHUNK_BYTES,
        ),
    )
    try:
        prompts = [make_prompt_tokens(PROMPT_LEN, 300 + i) for i in range(4)]
        for tokens in prompts:  # 4 prompts of 7 blocks: more than the engine cache and the primary
            _generate(llm, tokens)
        for tokens in prompts[:2]:  # again: looked up in raykv's tier
            _generate(llm, tokens)
        _generate(llm, make_prompt_tokens(16, 399), max_tokens=2)  # a short last one: its steps carry the stats
        metrics = llm.get_metrics()
        cost = read_step_cost(metrics)
        lookups: dict[str, float] = {}
        unanswered: dict[str, float] = {}  # first lookups the node's view left to ask for, by why
        for m in metrics:
            if m.name == "vllm:raykv_lookup_view_unanswered" and hasattr(m, "value"):
                why = m.labels.get("why", "?")
                unanswered[why] = unanswered.get(why, 0.0) + m.value
            elif m.name.startswith("vllm:raykv_lookup_") and hasattr(m, "value"):
                key = m.name.removeprefix("vllm:raykv_lookup_")
                lookups[key] = lookups.get(key, 0.0) + m.value
        lookups = {**lookups, **{f"view_unanswered[{why}]": n for why, n in unanswered.items()}}
        print(f"[{name}] raykv step cost {cost}; lookups {lookups}")
        yield name, cost, lookups
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        services.shutdown()


def test_step_and_request_costs_are_measured_after_traffic(served) -> None:
    name, cost, lookups = served
    requests = 4 + 2  # before the short last one, whose finish may not be reported yet
    # Each request takes a prefill step and OUTPUT_TOKENS - 1 decode steps, at least.
    assert cost["steps"] >= requests * OUTPUT_TOKENS, cost
    assert cost["tier_seconds"] > 0, cost
    assert 0 < cost["step_seconds_mean"] < GENEROUS_STEP_S, cost
    assert cost["step_seconds_p50"] is not None and cost["step_seconds_p50"] <= GENEROUS_STEP_S, cost
    assert cost["step_seconds_p99"] is not None and cost["step_seconds_p99"] <= 1.0, cost
    assert cost["step_seconds_p50"] <= cost["step_seconds_p99"], cost
    assert cost["polls"] > 0 and cost["polls_per_step"] is not None, cost
    # RETRYs per request: every finished request is counted, with the RETRYs it got.
    assert cost["requests"] >= requests, cost
    assert cost["retries_per_request"] is not None and cost["retries"] >= 0, cost
    assert cost["retries"] <= lookups.get("retries", 0.0), (cost, lookups)
    unanswered = {k[len("view_unanswered[") : -1]: n for k, n in lookups.items() if k.startswith("view_unanswered[")}
    if name == "defaults":
        # The node's view is complete: it knows every key, new ones as held by nobody. A request's
        # first lookup asks the agent (waits, and may get RETRY) only when the view could not be
        # read: its agent was mid-change for longer than a reader waits (``busy``), which a 2-core
        # host running vLLM's engine beside it can do. Each such lookup is counted, with its why.
        assert set(unanswered) <= {"busy"}, (unanswered, lookups)
        busy = unanswered.get("busy", 0.0)
        assert busy <= 2, lookups  # of the 6 requests' first lookups: more says the agent holds its changes too long
        assert cost["lookup_waits"] <= busy, (cost, lookups)
        assert lookups.get("retries", 0.0) <= busy and cost["retries"] <= busy, (cost, lookups)
    else:  # views of asked keys only: a new prefix is not known there, and is asked
        assert unanswered.get("not known", 0.0) > 0, lookups
    if name == "asked_keys":
        assert cost["lookup_waits"] > 0, cost  # a request's first lookup waits up to 5 ms
    elif name == "no_retry":
        assert cost["lookup_waits"] == 0, cost  # lookup_wait_ms 0: it never waits


def test_without_a_retry_budget_no_request_gets_retry(served) -> None:
    name, cost, lookups = served
    if name != "no_retry":
        pytest.skip("the no_retry engine's")
    assert lookups.get("retries", 0.0) == 0, lookups
    assert cost["retries"] == 0, cost
    assert lookups.get("retry_budget_misses", 0.0) > 0, lookups  # counted: they computed instead
