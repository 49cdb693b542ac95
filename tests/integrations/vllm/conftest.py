"""Fixtures for tests that run real vLLM (CPU backend) in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vllm_env() -> None:
    """Env that vLLM's spawned engine/worker processes need."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Spawned processes must import raykv (the spec is loaded by module path)
    # even when it is not pip-installed.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, paths)])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from raykv.models.tiny import MODEL_NAME, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME)
