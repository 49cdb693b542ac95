"""The cluster and Serve LLM app that ``raykv bench routing`` and ``raykv bench serve`` start.

One ``ray.cluster_utils.Cluster`` with one simulated node per replica (each
node offers one ``llm_slot``, so Serve places one replica per node), and a Ray
Serve LLM app of vLLM replicas on the CPU backend with small engine caches
(``ENGINE_BLOCKS`` blocks of 128 tokens: prompts leave the engine's own cache
as they would under a real deployment's load). Both benchmarks build their
apps here, so a change to how engines join the cluster reaches both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from raykv.core import signals
from raykv.core.wire import JsonValue

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster
    from ray.serve import Application

ENGINE_BLOCKS = 24
#: vLLM wants (ENGINE_BLOCKS - 1) x 128 >= it.
MAX_MODEL_LEN = 2048
HEAD_CPUS = 6
NODE_CPUS = 4
OBJECT_STORE_BYTES = 256 << 20


def start_cluster(replicas: int, model: str | None = None) -> Cluster:
    """An embedded cluster of ``replicas`` simulated nodes (the head is one), with the
    driver connected (``ray.init``), once ``replicas`` engines of ``model`` are known to
    fit in memory (``check_replicas_fit``). Shut it down with ``ray.shutdown()`` then
    ``cluster.shutdown()``."""
    import ray
    from ray.cluster_utils import Cluster

    from raykv.demo.replicas import check_replicas_fit

    check_replicas_fit(replicas, model)

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": HEAD_CPUS, "object_store_memory": OBJECT_STORE_BYTES, "resources": {"llm_slot": 1}},
    )
    for _ in range(replicas - 1):
        cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES, resources={"llm_slot": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    signals.after_ray_init()
    return cluster


def bench_app(
    model: str,
    *,
    model_id: str,
    replicas: int,
    router: str,
    raykv: Mapping[str, JsonValue] | bool,
    cpu_bytes: int = 0,
    engine_cache: bool | None = None,
    engine_kwargs: Mapping[str, JsonValue] | None = None,
    **llm_config_kwargs: object,
) -> Application:
    """The Serve LLM app of ``replicas`` vLLM replicas of ``model`` (served as ``model_id``),
    one per simulated node, under ``router`` (see ``raykv.serve.ROUTERS``).

    ``raykv``: raykv's config (namespace, tiers) attached through vLLM's offloading
    connector with a CPU primary of ``cpu_bytes`` per replica, or ``False`` for plain
    vLLM (its own prefix cache only, no offload). ``engine_cache``: record the engines'
    caches in raykv's directory (vLLM KV events; default: with the raykv router). ``engine_kwargs`` adds to or overrides
    the engines' arguments; the remaining keyword arguments go to ``LLMConfig``."""
    import ray

    from raykv.serve import build_app

    kwargs: dict[str, JsonValue] = {
        "max_model_len": MAX_MODEL_LEN,
        "num_gpu_blocks_override": ENGINE_BLOCKS,
        "enforce_eager": True,
        "enable_prompt_tokens_details": True,
        **(engine_kwargs or {}),
    }
    return build_app(
        model,
        model_id=model_id,
        raykv=raykv,
        cpu_bytes=cpu_bytes,
        engine_kwargs=kwargs,
        accelerator="cpu",
        num_replicas=replicas,
        router=router,
        engine_cache=engine_cache,
        placement_group_config={"bundles": [{"CPU": 1, "llm_slot": 1}]},
        env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address},
        **llm_config_kwargs,
    )
