"""KV identity end to end: real vLLM replicas of two models with identical
shapes (same tokenizer, same block hashes for the same prompt) and different
weights, in one raykv namespace on a two-node ``ray.cluster_utils.Cluster``.

Neither model ever gets a cached token from the other's prompts; engines of
one model still share blocks across nodes; a weight update in place (same
path, new weights) never serves the old KV; neither does an engine of the same
files whose settings change its KV (``hf_overrides``); ``raykv invalidate`` empties an
identity from every tier and the directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

import pytest
import ray

from raykv.core import naming
from raykv.demo.replicas import start_replica
from raykv.demo.tiny_model import make_prompt_tokens, reseed_weights
from raykv.integrations.vllm import raykv_kv_transfer_config
from raykv.ops.status import collect_status
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "raykv-identity"
PROMPT_LEN = 1001
CACHEABLE = (PROMPT_LEN // 128) * 128
ENGINE = {"max_model_len": 2048, "num_gpu_blocks_override": 20, "enforce_eager": True}
MIB = 1024 * 1024


_FS_ROOT: list[str] = []  # the module's fs root (set by the fixture)


def _held(nodes: list[str]) -> dict[str, set[bytes]]:
    """Every tier actor's keys: each node's object store, and the fs root."""
    out = {}
    for node in nodes:
        actor = ray.get_actor(naming.object_store_actor(node), namespace=NAMESPACE)
        out[node] = set(ray.get(actor.keys.remote()))
    fs = ray.get_actor(naming.fs_actor(_FS_ROOT[0]), namespace=NAMESPACE)
    out["fs"] = set(ray.get(fs.keys.remote()))
    return out


@pytest.fixture(scope="module")
def cluster(two_node_raykv, tiny_model, tmp_path_factory) -> dict[str, Any]:
    services, nodes = two_node_raykv
    # model B: the same architecture, tokenizer and shapes as A, other weights
    models = tmp_path_factory.mktemp("identity-models")
    model_a = str(shutil.copytree(tiny_model, models / "model-a"))
    model_b = str(shutil.copytree(tiny_model, models / "model-b"))
    reseed_weights(model_b, seed=4321)
    root = str(tmp_path_factory.mktemp("identity-fs") / "kv")
    _FS_ROOT[:] = [root]
    cfg = raykv_kv_transfer_config(
        {
            "namespace": NAMESPACE,
            "tiers": [{"type": "object_store", "capacity_bytes": 64 * MIB}, {"type": "fs", "root": root}],
        },
        cpu_bytes=64 * (128 << 10),
    )
    return {"services": services, "nodes": nodes, "model_a": model_a, "model_b": model_b, "cfg": cfg}


def _replica(node: str, model: str, cfg: dict[str, Any]) -> Any:
    return _replicas([(node, model)], cfg)[0]


def _replicas(
    where: list[tuple[str, str]], cfg: dict[str, Any], engine: list[dict[str, Any]] | None = None
) -> list[Any]:
    """Replicas of (node, model), started together (an engine start is most of this module's time);
    ``engine``: each one's engine options beyond ``ENGINE``."""
    extra = engine or [{}] * len(where)
    replicas = [start_replica(node, model, cfg, {**ENGINE, **more}) for (node, model), more in zip(where, extra)]
    ray.get([r.ready.remote() for r in replicas], timeout=300)
    return replicas


def test_models_with_equal_shapes_never_share_blocks(cluster) -> None:
    nodes, cfg = cluster["nodes"], cluster["cfg"]
    a1, b1 = _replicas([(nodes[0], cluster["model_a"]), (nodes[1], cluster["model_b"])], cfg)
    try:
        prompt = make_prompt_tokens(PROMPT_LEN, 11)
        on_a1 = ray.get(a1.generate.remote(prompt))
        assert on_a1.cached_tokens == 0
        wait_until(
            lambda: sum(map(len, _held(nodes).values())) >= CACHEABLE // 128,
            timeout_s=30.0,
            what="A's blocks in plasma",
        )

        # B sees the same block hashes, in the same namespace: never A's KV.
        on_b1 = ray.get(b1.generate.remote(prompt))
        assert on_b1.cached_tokens == 0, "model B was served model A's KV"
        assert on_b1.top_logprobs != on_a1.top_logprobs, "the two models must differ for this test to mean anything"
        # ...and A never gets B's KV for a prompt B computed first.
        other = make_prompt_tokens(PROMPT_LEN, 12)
        on_b1_other = ray.get(b1.generate.remote(other))
        assert on_b1_other.cached_tokens == 0
        wait_until(
            lambda: sum(map(len, _held(nodes).values())) >= 2 * CACHEABLE // 128,
            timeout_s=30.0,
            what="B's blocks in plasma",
        )
        on_a1_other = ray.get(a1.generate.remote(other))
        assert on_a1_other.cached_tokens == 0, "model A was served model B's KV"

        # Fresh replicas of each identity, each on the other node (both prompts are stored by now).
        a2, b2 = _replicas([(nodes[1], cluster["model_a"]), (nodes[0], cluster["model_b"])], cfg)
        try:
            # Equal identity, other node: A's blocks are a hit, outputs equal A's recompute.
            on_a2 = ray.get(a2.generate.remote(prompt))
            assert on_a2.cached_tokens == CACHEABLE
            assert on_a2.token_ids == on_a1.token_ids
            assert on_a2.top_logprobs == on_a1.top_logprobs
            # B's own prompt, from another replica of B's identity? B's blocks
            # stayed B's: a fresh B replica finds them.
            on_b2 = ray.get(b2.generate.remote(other))
            assert on_b2.cached_tokens == CACHEABLE
            assert on_b2.top_logprobs == on_b1_other.top_logprobs
        finally:
            ray.get([a2.shutdown.remote(), b2.shutdown.remote()], timeout=60)
    finally:
        ray.get([a1.shutdown.remote(), b1.shutdown.remote()], timeout=60)

    # status shows both identities, by model
    status = collect_status(cluster["services"], metrics=False)
    by_model = {i["model"]: i["blocks"] for i in status["identities"]}
    assert by_model[cluster["model_a"]] >= 2 * CACHEABLE // 128  # prompt, other (computed by A too)
    assert by_model[cluster["model_b"]] >= 2 * CACHEABLE // 128


def test_weight_update_in_place_never_serves_old_kv_and_invalidate_empties_it(cluster, tmp_path) -> None:
    nodes, cfg, services = cluster["nodes"], cluster["cfg"], cluster["services"]
    model = str(shutil.copytree(cluster["model_a"], tmp_path / "rolling"))
    prompt = make_prompt_tokens(PROMPT_LEN, 21)
    old = _replica(nodes[0], model, cfg)
    try:
        before = ray.get(old.generate.remote(prompt))
        assert before.cached_tokens == 0
        wait_until(
            lambda: any(
                i["model"] == model and i["blocks"] >= CACHEABLE // 128
                for i in collect_status(services, metrics=False)["identities"]
            ),
            timeout_s=30.0,
            what="the old weights' blocks",
        )
    finally:
        ray.get(old.shutdown.remote(), timeout=60)

    reseed_weights(model, seed=99)  # the weight update: same path, same shapes
    new = _replica(nodes[1], model, cfg)
    try:
        after = ray.get(new.generate.remote(prompt))
        assert after.cached_tokens == 0, "the updated model was served the old weights' KV"
        assert after.top_logprobs != before.top_logprobs
        again = ray.get(new.generate.remote(prompt))
        assert again.top_logprobs == after.top_logprobs
    finally:
        ray.get(new.shutdown.remote(), timeout=60)

    # both revisions of the model are known; the CLI drops every block of them
    mine = [i for i in collect_status(services, metrics=False)["identities"] if i["model"] == model]
    assert len(mine) == 2 and all(i["blocks"] > 0 for i in mine)
    tags = {bytes.fromhex(i["tag"]) for i in mine}
    held = _held(nodes)
    doomed = [k for keys in held.values() for k in keys if k[:8] in tags]
    kept = {k for keys in held.values() for k in keys if k[:8] not in tags}
    assert doomed and kept
    assert all(services.directory.lookup(doomed, timeout=30))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "raykv.ops.cli",
            "invalidate",
            "--model",
            model,
            "--namespace",
            NAMESPACE,
            "--address",
            ray.get_runtime_context().gcs_address,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"{len(doomed)} blocks dropped" in out.stdout, out.stdout
    held = _held(nodes)
    assert not [k for keys in held.values() for k in keys if k[:8] in tags], "a tier still holds invalidated blocks"
    assert {k for keys in held.values() for k in keys} == kept  # nobody else's blocks went
    assert not any(services.directory.lookup(doomed, timeout=30)), "the directory still lists invalidated blocks"
    assert all(services.directory.lookup(list(kept), timeout=30))
    status = collect_status(services, metrics=False)
    assert all(i["blocks"] == 0 for i in status["identities"] if i["model"] == model)


def test_engine_settings_that_change_the_kv_never_share_it(cluster) -> None:
    """The same model files under other settings that change the KV bytes (RoPE's base,
    through vLLM's ``hf_overrides``): equal block hashes, equal KV dtype and layout,
    never each other's blocks. The identities tell the two apart by their engine config."""
    nodes, cfg, services = cluster["nodes"], cluster["cfg"], cluster["services"]
    model = cluster["model_a"]
    rope = {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}}
    plain, other = _replicas([(nodes[0], model), (nodes[1], model)], cfg, engine=[{}, rope])
    try:
        prompt = make_prompt_tokens(PROMPT_LEN, 31)
        before = sum(map(len, _held(nodes).values()))
        on_plain = ray.get(plain.generate.remote(prompt))
        assert on_plain.cached_tokens == 0
        wait_until(
            lambda: sum(map(len, _held(nodes).values())) >= before + CACHEABLE // 128,
            timeout_s=30.0,
            what="the plain engine's blocks in the tiers",
        )
        on_other = ray.get(other.generate.remote(prompt))
        assert on_other.cached_tokens == 0, "an engine with other RoPE settings was served the plain engine's KV"
        assert on_other.top_logprobs != on_plain.top_logprobs, "the override must change the KV for this test to mean"
    finally:
        ray.get([plain.shutdown.remote(), other.shutdown.remote()], timeout=60)

    mine = [i for i in services.identities(timeout=30).values() if i.model == model]
    configs = [i.layout["engine_config"] for i in mine]
    assert all(isinstance(c, dict) for c in configs), f"an engine's config was out of reach: {configs}"
    assert len({c["hf_config"] for c in configs}) == 2, configs  # type: ignore[index]
    assert {c["model_dtype"] for c in configs} == {"torch.bfloat16"}, configs  # type: ignore[index]
