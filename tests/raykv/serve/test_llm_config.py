"""``raykv.serve.llm_config``'s engine environment (no cluster: the config object only)."""

from __future__ import annotations

import pytest

from raykv.core.logs import LOG_LEVEL_ENV


def test_the_deployers_raykv_log_level_reaches_the_engines(tiny_model, monkeypatch) -> None:
    pytest.importorskip("ray.serve.llm")
    from raykv.serve import llm_config

    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    quiet = llm_config(tiny_model, model_id="m", accelerator="cpu")
    assert LOG_LEVEL_ENV not in quiet.runtime_env["env_vars"]

    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
    loud = llm_config(tiny_model, model_id="m", accelerator="cpu")
    assert loud.runtime_env["env_vars"][LOG_LEVEL_ENV] == "debug"
    # an explicit engine environment wins
    own = llm_config(tiny_model, model_id="m", accelerator="cpu", env={LOG_LEVEL_ENV: "warning"})
    assert own.runtime_env["env_vars"][LOG_LEVEL_ENV] == "warning"


def test_deployment_config_and_runtime_env_merge_with_raykvs(tiny_model) -> None:
    """A caller's ``deployment_config`` (autoscaling) and ``runtime_env`` join raykv's
    router and ``RAY_ADDRESS`` rather than dropping them."""
    pytest.importorskip("ray.serve.llm")
    from raykv.serve import llm_config

    autoscaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    cfg = llm_config(
        tiny_model,
        accelerator="cpu",
        router="raykv",
        deployment_config={"autoscaling_config": autoscaling, "max_ongoing_requests": 32},
        runtime_env={"env_vars": {"HF_HOME": "/mnt/hf"}, "pip": ["numpy"]},
    )
    deployment = cfg.deployment_config
    assert deployment["autoscaling_config"] == autoscaling and deployment["max_ongoing_requests"] == 32
    assert "num_replicas" not in deployment  # Serve takes num_replicas or autoscaling_config, not both
    assert deployment["request_router_config"]["request_router_class"] == "raykv.serve.router.RaykvRequestRouter"
    env = cfg.runtime_env["env_vars"]
    assert env["HF_HOME"] == "/mnt/hf" and "RAY_ADDRESS" in env
    assert cfg.runtime_env["pip"] == ["numpy"]

    assert llm_config(tiny_model, accelerator="cpu", num_replicas="auto").deployment_config["num_replicas"] == "auto"
    with pytest.raises(ValueError, match="request_router_config: set by router='raykv'"):
        llm_config(tiny_model, router="raykv", deployment_config={"request_router_config": {}})
    with pytest.raises(ValueError, match="runtime_env must be a mapping"):
        llm_config(tiny_model, accelerator="cpu", runtime_env=["x"])


def test_app_builder_takes_serve_yaml_replica_counts(tiny_model) -> None:
    """``serve run ... num_replicas=2`` arrives as a string; ``auto`` is Serve's autoscaling."""
    pytest.importorskip("ray.serve.llm")
    from raykv.serve import app_builder

    args = {"model": tiny_model, "accelerator": "cpu"}
    assert app_builder({**args, "num_replicas": "2"}) is not None
    assert app_builder({**args, "num_replicas": "auto"}) is not None
    for bad in ("0", "-1", "two", True):
        with pytest.raises(ValueError, match="num_replicas: must be a positive integer or 'auto'"):
            app_builder({**args, "num_replicas": bad})


def test_a_callers_kv_transfer_config_adds_to_raykvs_or_is_refused(tiny_model) -> None:
    """``engine_kwargs["kv_transfer_config"]`` used to be replaced by raykv's without a word.
    Its extra options and fields now join raykv's OffloadingConnector; another connector, or a
    field raykv sets, is refused naming the field."""
    pytest.importorskip("ray.serve.llm")
    from raykv.serve import llm_config

    own = {
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"offload_prompt_only": False, "block_size": 256},
    }
    cfg = llm_config(tiny_model, accelerator="cpu", router="raykv", engine_kwargs={"kv_transfer_config": own})
    kv = cfg.engine_kwargs["kv_transfer_config"]
    extra = kv["kv_connector_extra_config"]
    assert kv["kv_connector"] == "OffloadingConnector" and kv["kv_load_failure_policy"] == "recompute"
    assert extra["offload_prompt_only"] is False and extra["block_size"] == 256
    assert extra["spec_name"] == "RaykvOffloadingSpec" and extra["secondary_tiers"]
    assert "raykv_engine_events" in extra  # the raykv router's engine events are still on

    with pytest.raises(ValueError, match=r"kv_transfer_config.kv_connector: .*'NixlConnector'.*raykv=False"):
        llm_config(tiny_model, engine_kwargs={"kv_transfer_config": {"kv_connector": "NixlConnector"}})
    for key, how in (("cpu_bytes_to_use", "cpu_bytes"), ("secondary_tiers", "tiers"), ("spec_name", "raykv")):
        bad = {"kv_connector_extra_config": {key: 1}}
        with pytest.raises(ValueError, match=rf"kv_connector_extra_config.{key}: set by raykv; use .*{how}"):
            llm_config(tiny_model, engine_kwargs={"kv_transfer_config": bad})
    # names of raykv_kv_transfer_config's own arguments are options like any other here
    odd = {"kv_connector_extra_config": {"vllm_tiers": "x", "cpu_bytes": 1}}
    kv = llm_config(tiny_model, engine_kwargs={"kv_transfer_config": odd}).engine_kwargs["kv_transfer_config"]
    assert kv["kv_connector_extra_config"]["vllm_tiers"] == "x" and kv["kv_connector_extra_config"]["cpu_bytes"] == 1
    with pytest.raises(ValueError, match="engine_kwargs.kv_transfer_config must be a mapping"):
        llm_config(tiny_model, engine_kwargs={"kv_transfer_config": "OffloadingConnector"})
    # raykv=False: the caller's own connector, untouched
    plain = llm_config(tiny_model, raykv=False, engine_kwargs={"kv_transfer_config": {"kv_connector": "X"}})
    assert plain.engine_kwargs["kv_transfer_config"] == {"kv_connector": "X"}


def test_the_identity_options_reach_the_engines(tiny_model) -> None:
    """``model_revision`` / ``weights_fingerprint``, as ``raykv_kv_transfer_config`` takes them
    (and ``serve run raykv.serve:app_builder model_revision=...``), checked by name."""
    pytest.importorskip("ray.serve.llm")
    from raykv.core.validate import ArgumentError
    from raykv.serve import llm_config

    cfg = llm_config(tiny_model, accelerator="cpu", model_revision="2026-12-04", weights_fingerprint="none")
    extra = cfg.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["raykv_model_revision"] == "2026-12-04" and extra["raykv_weights_fingerprint"] == "none"
    with pytest.raises(ArgumentError, match="weights_fingerprint"):
        llm_config(tiny_model, accelerator="cpu", weights_fingerprint="md5")
    with pytest.raises(ValueError, match="raykv=False: model_revision"):
        llm_config(tiny_model, raykv=False, model_revision="r1")


def test_rays_warning_that_kv_events_go_unread_is_dropped_only_when_raykv_reads_them(tiny_model) -> None:
    """Ray Serve LLM warns, building an app whose engines publish KV events without its
    KVAwareRouter, that the events "will not be consumed". raykv's connector reads them
    (the engine-cache record behind the raykv router): not a word then. Events that
    nobody reads (the caller's own ``kv_events_config``, ``engine_cache=False``) keep it."""
    pytest.importorskip("ray.serve.llm")
    import logging

    from raykv.serve import EVENTS_UNUSED_WARNING, build_app

    heard: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    serve_logger, collect = logging.getLogger("ray.serve"), Collect(level=logging.WARNING)
    serve_logger.addHandler(collect)
    try:
        build_app(tiny_model, accelerator="cpu", router="raykv")
        assert not [m for m in heard if m.startswith(EVENTS_UNUSED_WARNING)], heard
        assert serve_logger.filters == []  # dropped while building, and only then
        own_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
        build_app(tiny_model, accelerator="cpu", engine_cache=False, engine_kwargs={"kv_events_config": own_events})
        assert [m for m in heard if m.startswith(EVENTS_UNUSED_WARNING)], heard
    finally:
        serve_logger.removeHandler(collect)
