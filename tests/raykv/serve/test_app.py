"""Ray Serve LLM with raykv attached: a real Serve app (tiny model on CPU) answering
OpenAI-style requests from two clients; a long prompt repeated after it left the
engine's cache and the CPU primary comes back from raykv's fs tier."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import requests

from raykv.core import naming
from raykv.demo.tiny_model import make_prompt_tokens
from tests.clusters import start_local_ray
from tests.waiting import WaitTimeout, wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "raykv-serve-test"
MODEL_ID = "tiny"
PROMPT_LEN = 1001
CACHEABLE = (PROMPT_LEN // 128) * 128
URL = "http://127.0.0.1:8000/v1/completions"


@pytest.fixture(scope="module")
def serve_app(vllm_env, tiny_model, tmp_path_factory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("ray.serve.llm")
    from ray import serve

    from raykv.serve import build_app

    start_local_ray(num_cpus=4, object_store_memory=512 << 20)
    root = str(tmp_path_factory.mktemp("serve-fs"))
    app = build_app(
        tiny_model,
        model_id=MODEL_ID,
        raykv={"namespace": NAMESPACE, "tiers": [{"type": "fs", "root": root}]},
        cpu_bytes=16 * (128 << 10),  # 16 chunks: less than the 4 prompts' 28
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
        lambda: requests.get("http://127.0.0.1:8000/v1/models", timeout=5).ok,
        timeout_s=420,
        interval_s=1,
        ignore=(requests.RequestException,),
        what="the Serve LLM app to come up",
    )
    print(f"Serve LLM app ready in {time.perf_counter() - t0:.0f} s")
    yield {"root": root}
    serve.shutdown()
    ray.shutdown()


def _complete(tokens: list[int]) -> dict[str, Any]:
    body = {"model": MODEL_ID, "prompt": tokens, "max_tokens": 1, "temperature": 0.0, "logprobs": 5}
    r = requests.post(URL, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict[str, Any]) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _fs_keys(root: str) -> int:
    fs_actor = ray.get_actor(naming.fs_actor(root), namespace=NAMESPACE)
    return len(ray.get(fs_actor.keys.remote()))


def _wait_fs_keys(root: str, at_least: int, what: str, timeout_s: float = 60.0) -> int:
    """Wait until the fs tier lists ``at_least`` keys and its count stopped changing for 1 s."""
    last, since = -1, time.monotonic()

    def settled() -> bool:
        nonlocal last, since
        n = _fs_keys(root)
        if n != last:
            last, since = n, time.monotonic()
        return n >= at_least and time.monotonic() - since >= 1.0

    try:
        wait_until(settled, timeout_s=timeout_s, interval_s=0.2, what=f"{what}: {at_least} keys in the fs tier")
    except WaitTimeout as e:
        raise AssertionError(f"{what}: the fs tier lists {last} keys, wanted {at_least}") from e
    print(f"{what}: the fs tier lists {last} keys")
    return last


@pytest.mark.serve
def test_two_clients_and_a_repeated_prompt_served_by_raykv(serve_app) -> None:
    root = serve_app["root"]
    _complete(make_prompt_tokens(200, 500))  # one-off kernel set-up (1 full block)
    prompt = make_prompt_tokens(PROMPT_LEN, 0)
    cold = _complete(prompt)
    assert _cached(cold) == 0
    # The prompt's blocks cascade to the fs tier before anything can push them out.
    before = _wait_fs_keys(root, 1 + PROMPT_LEN // 128, "after the cold prompt")

    # Two clients at once push the prompt out of the engine cache and the primary.
    answers: dict[int, dict[str, Any]] = {}

    def client(seeds: list[int]) -> None:
        for s in seeds:
            answers[s] = _complete(make_prompt_tokens(PROMPT_LEN, s))

    threads = [threading.Thread(target=client, args=(seeds,)) for seeds in ([1, 3], [2, 4])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(answers) == [1, 2, 3, 4]
    assert all(a["choices"][0]["text"] is not None for a in answers.values())
    # The clients' prompts reach the fs tier too (vLLM's cascade is best effort:
    # a block whose primary slot could not be had while others were pinned is
    # skipped, so not necessarily every one of them).
    _wait_fs_keys(root, before + PROMPT_LEN // 128, "after the clients")

    warm = _complete(prompt)
    assert _cached(warm) == CACHEABLE, warm["usage"]
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["choices"][0]["logprobs"]["top_logprobs"] == cold["choices"][0]["logprobs"]["top_logprobs"]
    # raykv's directory knows the fs tier's blocks (the services were started by the replica)
    services_ns = ray.get_actor(naming.CONTROL_ACTOR, namespace=NAMESPACE)
    assert ray.get(services_ns.holders.remote())


def test_serve_yaml_builds_an_app_with_raykv(tiny_model) -> None:
    """cluster_configs/serve_llm.yaml's app builds (raykv's kv_transfer_config inside)."""
    pytest.importorskip("ray.serve.llm")
    from pathlib import Path

    import yaml

    from raykv.serve import app_builder, llm_config

    path = Path(__file__).resolve().parents[3] / "cluster_configs" / "serve_llm.yaml"
    (app_cfg,) = yaml.safe_load(path.read_text())["applications"]
    assert app_cfg["import_path"] == "raykv.serve:app_builder"
    args = dict(app_cfg["args"], model=tiny_model)
    assert app_builder(args) is not None
    cfg = llm_config(**{k: v for k, v in args.items() if k not in ("model",)}, model=tiny_model)
    tiers = cfg.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]["secondary_tiers"]
    assert [t["type"] for t in tiers] == ["RaykvObjectStoreTier", "RaykvFsTier"]
    assert {t["namespace"] for t in tiers} == {"raykv"}
    assert args["router"] == "raykv"
    router = cfg.deployment_config["request_router_config"]
    assert router["request_router_class"] == "raykv.serve.router.RaykvRequestRouter"
    assert router["request_router_kwargs"] == {"model": tiny_model, "namespace": "raykv"}
    events = cfg.engine_kwargs["kv_events_config"]
    assert events["enable_kv_cache_events"] and events["endpoint"].startswith("inproc://")
    extra = cfg.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["raykv_engine_events"]["endpoint"] == events["endpoint"]
    with pytest.raises(ValueError, match="needs a 'model'"):
        app_builder({})
    # serve run ... cpu_bytes=8GiB: a size as an operator types it; a bare 8G is not guessed
    assert app_builder(dict(args, cpu_bytes="8GiB")) is not None
    with pytest.raises(ValueError, match="cpu_bytes: size unit 'G' is ambiguous"):
        app_builder(dict(args, cpu_bytes="8G"))
    # the same check as build_app's and kv_transfer_config's (raykv.integrations.vllm.config.cpu_bytes_arg)
    with pytest.raises(ValueError, match="app_builder cpu_bytes: must be >= 1, got 0"):
        app_builder(dict(args, cpu_bytes="0GiB"))


def test_router_choices(tiny_model) -> None:
    """Each router names its Serve class; the default router adds no engine events; bad values are refused."""
    pytest.importorskip("ray.serve.llm")
    from raykv.serve import llm_config

    plain = llm_config(tiny_model, accelerator="cpu")
    assert "request_router_config" not in plain.deployment_config
    assert "kv_events_config" not in plain.engine_kwargs
    affinity = llm_config(
        tiny_model, accelerator="cpu", router="prefix_affinity", router_kwargs={"imbalanced_threshold": 4}
    )
    assert affinity.deployment_config["request_router_config"]["request_router_class"].endswith(
        "PrefixCacheAffinityRouter"
    )
    recorded = llm_config(tiny_model, accelerator="cpu", engine_cache=True)
    assert recorded.engine_kwargs["kv_events_config"]["enable_kv_cache_events"]
    with pytest.raises(ValueError, match="router must be one of default, prefix_affinity, raykv"):
        llm_config(tiny_model, accelerator="cpu", router="fastest")
    with pytest.raises(ValueError, match="engine_cache must be true or false"):
        llm_config(tiny_model, accelerator="cpu", engine_cache="yes")
