"""Ray Serve LLM with raykv attached.

``llm_config(...)`` returns a ``ray.serve.llm.LLMConfig`` whose engine kwargs
carry raykv's ``kv_transfer_config``; ``build_app(...)`` wraps it in Ray
Serve's OpenAI-compatible app. Serve replicas run in the Ray namespace
"serve", so every raykv tier names raykv's own namespace explicitly, and a
replica starts the raykv services when none run there yet (idempotent). vLLM's
engine process joins the cluster through ``RAY_ADDRESS`` (``auto`` on a Ray
node).

For ``serve run`` / ``serve deploy``: ``cluster_configs/serve_llm.yaml`` names
``raykv.serve:app_builder`` as its import path, with these arguments as args.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from raykv.core.logs import LOG_LEVEL_ENV
from raykv.core.wire import JsonValue
from raykv.integrations.vllm import raykv_kv_transfer_config
from raykv.integrations.vllm.config import cpu_bytes_arg

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.llm import LLMConfig

#: raykv tiers of a Serve LLM app when none are given: each node's object store.
DEFAULT_TIERS: list[dict[str, object]] = [{"type": "object_store"}]
#: ``router`` choices: Serve's default (power of two choices), Ray's prefix-affinity router, raykv's.
ROUTERS = {
    "default": None,
    "prefix_affinity": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "raykv": "raykv.serve.router.RaykvRequestRouter",
}
#: vLLM KV events the raykv router needs: published in-process, read by raykv's tiers.
RAYKV_KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "inproc://raykv-kv-events",
    "topic": "raykv",
}


def llm_config(
    model: str,
    model_id: str | None = None,
    raykv: Mapping[str, object] | bool | None = None,
    *,
    cpu_bytes: int | str = 4 << 30,
    engine_kwargs: Mapping[str, object] | None = None,
    accelerator: str = "auto",
    num_replicas: int | str = 1,
    env: dict[str, str] | None = None,
    router: str = "default",
    router_kwargs: Mapping[str, object] | None = None,
    engine_cache: bool | None = None,
    model_revision: str | None = None,
    weights_fingerprint: str | None = None,
    **llm_config_kwargs: object,
) -> LLMConfig:
    """A ``LLMConfig`` for ``model`` with raykv's cluster cache attached.

    Args:
        model: model path or hub id (``model_source``).
        model_id: the name clients ask for (default: ``model``).
        raykv: raykv config (``namespace``, ``tiers``); default: the object
            store tier in namespace ``raykv``. ``False``: no raykv at all (plain
            vLLM with its own prefix cache, no offload: the baseline of a
            comparison; the raykv router and ``engine_cache`` need raykv).
        cpu_bytes: the CPU primary tier of each engine (bytes, or a size such as "8GiB").
        engine_kwargs: more vLLM engine arguments.
        accelerator: ``"cpu"``, ``"gpu"`` or ``"auto"`` (GPU when the cluster has one).
        num_replicas: Serve replicas of the deployment, or ``"auto"`` (Serve's autoscaling).
        llm_config_kwargs: more ``LLMConfig`` fields. ``deployment_config`` and
            ``runtime_env`` are merged with raykv's (the router, ``RAY_ADDRESS``),
            not swapped for them.
        env: extra environment variables for the replicas.
        router: how Serve picks a replica per request: ``default`` (power of
            two choices), ``prefix_affinity`` (Ray's PrefixCacheAffinityRouter)
            or ``raykv`` (by the directory: engine caches, raykv tiers, queues;
            it turns on the engines' KV events).
        router_kwargs: more options of the router (``request_router_kwargs``).
        engine_cache: record each engine's own KV cache in raykv's directory
            (vLLM's KV events; default: with the raykv router).
        model_revision, weights_fingerprint: the engines' KV identity options
            (``raykv.integrations.vllm.raykv_kv_transfer_config``: bump the revision on
            every weight update; ``none`` trusts the model name and revision alone).
    """
    from ray.serve.llm import LLMConfig

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {router!r}")
    attach = raykv is not False
    if raykv is True:
        raykv = None
    raykv_cfg = dict(raykv or {})
    raykv_cfg.setdefault("tiers", DEFAULT_TIERS)
    kwargs = dict(engine_kwargs or {})
    engine_events: dict[str, JsonValue] | None = None
    if engine_cache is None:
        engine_cache = router == "raykv"
    if not isinstance(engine_cache, bool):
        raise ValueError(f"engine_cache must be true or false; got {engine_cache!r}")
    if not attach and (router == "raykv" or engine_cache):
        raise ValueError("raykv=False: the raykv router and engine_cache need raykv attached")
    if not attach and (model_revision is not None or weights_fingerprint is not None):
        raise ValueError("raykv=False: model_revision and weights_fingerprint are raykv's KV identity options")
    if engine_cache:
        kwargs.setdefault("kv_events_config", dict(RAYKV_KV_EVENTS))
        ev = kwargs["kv_events_config"]
        if not isinstance(ev, Mapping):
            raise ValueError(f"engine_kwargs['kv_events_config'] must be a mapping; got {type(ev).__name__}")
        endpoint, topic = ev.get("endpoint"), ev.get("topic", "")
        engine_events = {"endpoint": None if endpoint is None else str(endpoint), "topic": str(topic)}
    if attach:
        identity = {"model_revision": model_revision, "weights_fingerprint": weights_fingerprint}
        kwargs["kv_transfer_config"] = _kv_transfer_config(
            raykv_cfg, cpu_bytes, engine_events, kwargs.get("kv_transfer_config"), identity
        )
    extra: dict[str, object] = dict(llm_config_kwargs)
    deployment = _mapping_arg(extra.pop("deployment_config", None), "deployment_config")
    replicas = _num_replicas(num_replicas, "num_replicas")
    if "num_replicas" not in deployment and "autoscaling_config" not in deployment:  # Serve takes one of them
        deployment["num_replicas"] = replicas
    if ROUTERS[router] is not None:
        if "request_router_config" in deployment:
            raise ValueError(
                f"deployment_config.request_router_config: set by router={router!r}; "
                "pass the router's options as router_kwargs"
            )
        router_options = dict(router_kwargs or {})
        if router == "raykv":
            router_options = {"model": model, "namespace": raykv_cfg.get("namespace", "raykv"), **router_options}
        deployment["request_router_config"] = {
            "request_router_class": ROUTERS[router],
            "request_router_kwargs": router_options,
        }
    runtime_env = _mapping_arg(extra.pop("runtime_env", None), "runtime_env")
    env_vars: dict[str, object] = {
        "RAY_ADDRESS": os.environ.get("RAY_ADDRESS", "auto"),
        **_mapping_arg(runtime_env.get("env_vars"), "runtime_env.env_vars"),
        **(env or {}),
    }
    if LOG_LEVEL_ENV in os.environ:  # the deployer's raykv log level reaches the engines
        env_vars.setdefault(LOG_LEVEL_ENV, os.environ[LOG_LEVEL_ENV])
    if _use_cpu(accelerator):
        extra.setdefault("accelerator_config", {"kind": "cpu"})
        extra.setdefault("placement_group_config", {"bundles": [{"CPU": 1}]})
        env_vars.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return LLMConfig.model_validate(
        {
            "model_loading_config": {"model_id": model_id or model, "model_source": model},
            "engine_kwargs": kwargs,
            "deployment_config": deployment,
            "runtime_env": {**runtime_env, "env_vars": env_vars},
            **extra,
        }
    )


def _kv_transfer_config(
    raykv_cfg: Mapping[str, object],
    cpu_bytes: int | str,
    engine_events: dict[str, JsonValue] | None,
    given: object,
    identity: Mapping[str, str | None],
) -> dict[str, JsonValue]:
    """raykv's ``kv_transfer_config``, with what the caller's own (``engine_kwargs``) adds to
    vLLM's ``OffloadingConnector``: its other fields and extra-config options are kept; another
    connector, or an extra option raykv sets, is refused rather than silently replaced."""
    where = "engine_kwargs.kv_transfer_config"
    own = _mapping_arg(given, where)
    connector = own.pop("kv_connector", "OffloadingConnector")
    if connector != "OffloadingConnector":
        raise ValueError(
            f"{where}.kv_connector: raykv attaches vLLM's OffloadingConnector, not {connector!r} "
            "(pass raykv=False to run another connector)"
        )
    own_extra = _mapping_arg(own.pop("kv_connector_extra_config", None), f"{where}.kv_connector_extra_config")
    events = {} if engine_events is None else {"raykv_engine_events": engine_events}
    base = raykv_kv_transfer_config(raykv_cfg, cpu_bytes=cpu_bytes, **identity, **events)  # type: ignore[arg-type]
    extra = base["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    for key, value in own_extra.items():
        if key in extra or key in ("spec_name", "spec_module_path"):
            how = {"cpu_bytes_to_use": "cpu_bytes=", "secondary_tiers": "raykv= (its tiers)"}.get(key, "raykv's own")
            raise ValueError(f"{where}.kv_connector_extra_config.{key}: set by raykv; use {how}")
        extra[key] = value  # type: ignore[assignment]
    return {**base, **own}  # type: ignore[dict-item]


def _mapping_arg(value: object, name: str) -> dict[str, object]:
    """A mapping argument as a fresh dict ({} when not given); ``ValueError`` naming it otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping; got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def build_app(model: str, **kwargs: object) -> Application:
    """Ray Serve's OpenAI-compatible app for ``llm_config(*args, **kwargs)``."""
    from ray.serve.llm import build_openai_app

    config = llm_config(model, **kwargs)  # type: ignore[arg-type]
    with _events_consumed_by_raykv(config):
        return build_openai_app({"llm_configs": [config]})


#: What Ray Serve LLM (2.60, ``routing_policies/kv_aware/utils.py``) warns while building an
#: app whose engines publish KV events but whose router is not its ``KVAwareRouter``.
EVENTS_UNUSED_WARNING = (
    "engine_kwargs['kv_events_config'] is set but the deployment's request router is not a KVAwareRouter"
)


class _DropEventsUnusedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(EVENTS_UNUSED_WARNING)


@contextmanager
def _events_consumed_by_raykv(config: LLMConfig) -> Iterator[None]:
    """Ray's warning that the engines' KV events "will not be consumed" is false when raykv's
    connector reads them (``engine_cache``: ``raykv.integrations.vllm.kv_events``): it is
    dropped then, and only then, while the app is built (on Serve's own logger)."""
    # (with raykv=False the caller's own kv_transfer_config is kept as given: any type)
    transfer = config.engine_kwargs.get("kv_transfer_config")
    extra = transfer.get("kv_connector_extra_config") if isinstance(transfer, Mapping) else None
    if not (isinstance(extra, Mapping) and extra.get("raykv_engine_events")):
        yield
        return
    serve_logger = logging.getLogger("ray.serve")  # Serve's logger, as Ray documents it
    drop = _DropEventsUnusedWarning()
    serve_logger.addFilter(drop)
    try:
        yield
    finally:
        serve_logger.removeFilter(drop)


def app_builder(args: Mapping[str, object]) -> Application:
    """Entry point for ``serve run raykv.serve:app_builder key=value ...`` and Serve YAMLs."""
    args = dict(args)
    model = args.pop("model", None)
    if not model or not isinstance(model, str):
        raise ValueError("raykv.serve:app_builder needs a 'model' argument (path or hub id)")
    if "cpu_bytes" in args:  # bytes, or a size such as 8GiB: checked here even when raykv=false
        try:
            args["cpu_bytes"] = cpu_bytes_arg(args["cpu_bytes"])
        except ValueError as e:
            raise ValueError(f"raykv.serve:app_builder {e}") from None
    if "num_replicas" in args:
        args["num_replicas"] = _num_replicas(args["num_replicas"], "raykv.serve:app_builder num_replicas")
    return build_app(model, **args)


def _num_replicas(value: object, what: str) -> int | str:
    """A replica count (a YAML arg may be the string "2") or Serve's ``"auto"`` (autoscaling)."""
    if value == "auto":
        return "auto"
    try:
        n = int(str(value)) if not isinstance(value, bool) else -1
    except ValueError:
        n = -1
    if n < 1:
        raise ValueError(f"{what}: must be a positive integer or 'auto', got {value!r}")
    return n


def _use_cpu(accelerator: str) -> bool:
    if accelerator not in ("auto", "cpu", "gpu"):
        raise ValueError(f"accelerator must be one of auto, cpu, gpu; got {accelerator!r}")
    if accelerator != "auto":
        return accelerator == "cpu"
    import ray

    return not (ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
