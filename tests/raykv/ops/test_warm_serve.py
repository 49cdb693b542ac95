"""``raykv warm`` against a real Ray Serve LLM app (tiny model on CPU, real vLLM
replica, raykv's object store and fs tiers), run through the CLI in a subprocess:
the tiers' stats show the prompt's blocks pinned for the tenant, and after a
flood of other prompts that cycles both tiers' capacity, the same prefix comes
back from raykv (cached tokens) for that tenant."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import requests

from raykv.demo.tiny_model import make_prompt_tokens
from tests.cli_run import run_raykv
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "raykv-warm-test"
MODEL_ID = "tiny"
TENANT = "agents"
PROMPT_LEN = 1001
BLOCK_TOKENS = 128
CACHEABLE = (PROMPT_LEN // BLOCK_TOKENS) * BLOCK_TOKENS
CHUNK_BYTES = 128 << 10  # the tiny model's 128-token block
#: Each tier holds 16 blocks: 8 may be pinned (max_pinned_fraction 0.5), the flood's 28 cycle the rest.
TIER_BYTES = 16 * CHUNK_BYTES
URL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def serve_app(vllm_env, tiny_model, tmp_path_factory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("ray.serve.llm")
    from ray import serve

    from raykv.serve import build_app

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, object_store_memory=512 << 20, include_dashboard=False, log_to_driver=False)
    root = str(tmp_path_factory.mktemp("warm-fs"))
    tiers = [
        {"type": "object_store", "capacity_bytes": TIER_BYTES},
        {"type": "fs", "root": root, "capacity_bytes": TIER_BYTES, "fsync": False},
    ]
    app = build_app(
        tiny_model,
        model_id=MODEL_ID,
        raykv={"namespace": NAMESPACE, "tiers": tiers},
        cpu_bytes=16 * CHUNK_BYTES,
        engine_kwargs={
            "max_model_len": 2048,
            "num_gpu_blocks_override": 20,
            "enforce_eager": True,
            "enable_prompt_tokens_details": True,
        },
        accelerator="cpu",
        env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address},
    )
    t0 = time.perf_counter()
    serve.run(app, name="raykv-llm", route_prefix="/", blocking=False)
    wait_until(
        lambda: requests.get(f"{URL}/v1/models", timeout=5).ok,
        timeout_s=420,
        interval_s=1,
        ignore=(requests.RequestException,),
        what="the Serve LLM app to come up",
    )
    print(f"Serve LLM app ready in {time.perf_counter() - t0:.0f} s")
    yield {"root": root}
    serve.shutdown()
    ray.shutdown()


def _complete(tokens: list[int], tenant: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_ID, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
    if tenant is not None:
        body["kv_transfer_params"] = {"tenant": tenant}
    r = requests.post(f"{URL}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict[str, Any]) -> int:
    return int((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _raykv(*args: str) -> subprocess.CompletedProcess:
    return run_raykv(*args, namespace=NAMESPACE, address=ray.get_runtime_context().gcs_address, timeout=600)


def _tier_figures() -> dict[str, dict[str, Any]]:
    """Tier type -> its (one) actor's stats figures."""
    import raykv

    services = raykv.attach(NAMESPACE)
    out = {}
    for info in services.holders():
        if info.tier_type in ("object_store", "fs"):
            actor = ray.get_actor(info.actor_name, namespace=NAMESPACE)
            out[info.tier_type] = ray.get(actor.stats.remote(), timeout=30).figures
    return out


@pytest.mark.serve
def test_warm_pins_a_prefix_that_survives_a_flood(serve_app, tmp_path) -> None:
    _complete(make_prompt_tokens(200, 500))  # one-off kernel set-up (1 full block, unpinned)
    prompt = make_prompt_tokens(PROMPT_LEN, 0)
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(json.dumps(prompt) + "\n")

    t0 = time.perf_counter()
    out = _raykv("warm", "--prompt-file", str(prompt_file), "--ttl", "600", "--tenant", TENANT, "--json")
    print(f"raykv warm took {time.perf_counter() - t0:.1f} s:\n{out.stdout}\n{out.stderr[-2000:]}")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    blocks = CACHEABLE // BLOCK_TOKENS
    assert report["model"] == MODEL_ID and report["tenant"] == TENANT and report["ttl_s"] == 600
    assert report["prompts"] == [
        {"prompt_tokens": PROMPT_LEN, "cached_tokens": 0, "seconds": pytest.approx(0, abs=300)}
    ]
    assert report["ended"] == "settled"
    assert report["per_tier"]["object_store"] == {"blocks": blocks, "bytes": blocks * CHUNK_BYTES}, report
    assert report["per_tier"]["fs"]["blocks"] == blocks, report
    assert report["blocks_pinned"] == sum(t["blocks"] for t in report["per_tier"].values())

    # The tiers' own stats show the tenant's pins.
    for tier, figures in _tier_figures().items():
        assert figures["pinned_blocks"] == blocks, (tier, figures)
        # (an fs file holds a small header besides its block)
        pinned = figures["tenant_pinned_bytes"]
        assert list(pinned) == [TENANT] and 0 <= pinned[TENANT] - blocks * CHUNK_BYTES < blocks * 1024, (tier, figures)
        assert 590 < figures["pin_expiries"][0]["seconds_left"] <= 600

    # Plain text too: the totals per tier (the prefix is pinned already: no new blocks).
    text = _raykv("warm", "--prompt-file", str(prompt_file), "--ttl", "900", "--tenant", TENANT)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"warmed 1 prompts ({PROMPT_LEN} tokens) on {MODEL_ID}, ttl 900 s"), text.stdout
    # The engine's own cache answered it (nothing stored), yet the request renewed the pins
    # (raykv.engine.pin_renewal): they now last 900 s from it.
    for tier, figures in _tier_figures().items():
        assert 860 < figures["pin_expiries"][0]["seconds_left"] <= 900, (tier, figures["pin_expiries"])

    # A flood of unpinned prompts pushes the prefix out of the engine's cache and the
    # CPU primary, and cycles each tier's unpinned room (9 blocks) three times.
    for seed in range(1, 5):
        _complete(make_prompt_tokens(PROMPT_LEN, seed))
    for tier, figures in _tier_figures().items():
        assert figures["pinned_blocks"] == blocks, (tier, figures)
        evicted = figures["counters"]["evicted_blocks"] if tier == "object_store" else figures["evicted"]
        assert evicted > 0, (tier, figures)

    again = _complete(prompt, tenant=TENANT)
    assert _cached(again) == CACHEABLE, again["usage"]
