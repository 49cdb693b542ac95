"""Two vLLM engine replicas on two nodes of a ``ray.cluster_utils.Cluster``:
a prompt computed by replica A is a prefix hit on replica B through raykv."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from raykv.core import naming
from raykv.demo.replicas import start_replica
from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm import raykv_kv_transfer_config
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "raykv-xreplica"
PROMPT_LEN = 1001
CACHEABLE = (PROMPT_LEN // 128) * 128
ENGINE = {"max_model_len": 2048, "num_gpu_blocks_override": 20, "enforce_eager": True}


@pytest.fixture(scope="module")
def two_replicas(two_node_raykv, tiny_model) -> Iterator[tuple[Any, Any, list[str], Any]]:
    services, nodes = two_node_raykv
    mib = 1024 * 1024
    cfg = raykv_kv_transfer_config(
        {"namespace": NAMESPACE, "tiers": [{"type": "object_store", "capacity_bytes": 64 * mib}]},
        cpu_bytes=64 * (128 << 10),
    )
    a, b = (start_replica(node, tiny_model, cfg, ENGINE) for node in nodes[:2])
    info = ray.get([a.ready.remote(), b.ready.remote()], timeout=300)
    assert info[0].node_id != info[1].node_id
    yield a, b, nodes, services
    ray.get([a.shutdown.remote(), b.shutdown.remote()], timeout=60)


def test_prompt_computed_on_one_node_is_a_prefix_hit_on_the_other(two_replicas) -> None:
    a, b, nodes, services = two_replicas
    prompt = make_prompt_tokens(PROMPT_LEN, 7)
    on_a = ray.get(a.generate.remote(prompt))
    assert on_a.cached_tokens == 0

    holder_a = ray.get_actor(naming.object_store_actor(nodes[0]), namespace=NAMESPACE)
    wait_until(  # the cascade lands after the request
        lambda: len(ray.get(holder_a.keys.remote())) >= CACHEABLE // 128,
        timeout_s=30,
        what="node A's object store to receive the prompt's blocks",
    )

    holder_b = ray.get_actor(naming.object_store_actor(nodes[1]), namespace=NAMESPACE)
    pulled_before = ray.get(holder_b.stats.remote()).figures["counters"].get("hits_remote", 0)
    on_b = ray.get(b.generate.remote(prompt))
    pulled = ray.get(holder_b.stats.remote()).figures["counters"].get("hits_remote", 0) - pulled_before
    print(f"TTFT on A (computed) {on_a.ttft_ms:.0f} ms; on B (from A's plasma) {on_b.ttft_ms:.0f} ms")

    assert on_b.cached_tokens == CACHEABLE
    assert pulled == CACHEABLE // 128, "replica B's blocks did not come from node A's plasma"
    assert on_b.token_ids == on_a.token_ids
    assert on_b.top_logprobs == on_a.top_logprobs

    # One identity for both engines, with their engine config read from vLLM (on each
    # release this runs on: the matrix runs this module on vLLM 0.29 too).
    (identity,) = services.identities(timeout=30).values()
    engine_config = identity.layout["engine_config"]
    assert isinstance(engine_config, dict), f"the engine's vLLM config was out of reach: {engine_config!r}"
    assert engine_config["model_dtype"] == "torch.bfloat16" and engine_config["hf_config"]
