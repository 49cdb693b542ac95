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
