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
