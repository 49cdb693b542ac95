"""Build vLLM's `kv_transfer_config` for raykv (no vLLM import needed)."""

from __future__ import annotations

import copy
from typing import Any

RAYKV_SPEC_NAME = "RaykvOffloadingSpec"
RAYKV_SPEC_MODULE = "raykv.integrations.vllm.spec"
DEFAULT_CPU_BYTES = 4 << 30

# Keys this builder owns; passing them through **extra would silently fight it.
_RESERVED = {"spec_name", "spec_module_path", "cpu_bytes_to_use", "secondary_tiers"}


def kv_transfer_config(
    secondary_tiers: list[dict[str, Any]] | None = None,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
    **extra: Any,
) -> dict[str, Any]:
    """The `kv_transfer_config` dict for `vllm.LLM(...)` / Ray Serve `engine_kwargs`.

    Args:
        secondary_tiers: tier configs, each `{"type": ..., ...}` (plus
            `"module_path"` for out-of-tree tiers); copied, never mutated.
        cpu_bytes: size of the CPU primary tier, in bytes.
        **extra: other `kv_connector_extra_config` keys (e.g. `block_size`,
            `eviction_policy`, `backpressure`).
    """
    if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes <= 0:
        raise ValueError(f"cpu_bytes must be a positive int, got {cpu_bytes!r}")
    clash = _RESERVED & extra.keys()
    if clash:
        raise ValueError(f"set {sorted(clash)} through kv_transfer_config's own arguments")
    tiers = list(secondary_tiers or [])
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict):
            raise ValueError(f"secondary_tiers[{i}] must be a dict, got {type(tier).__name__}")
        if not isinstance(tier.get("type"), str) or not tier["type"]:
            raise ValueError(f"secondary_tiers[{i}].type must be a non-empty string")
        module_path = tier.get("module_path")
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ValueError(f"secondary_tiers[{i}].module_path must be a non-empty string")
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": RAYKV_SPEC_NAME,
            "spec_module_path": RAYKV_SPEC_MODULE,
            "cpu_bytes_to_use": cpu_bytes,
            # vLLM's TieringOffloadingSpec writes into these dicts: hand it copies.
            "secondary_tiers": copy.deepcopy(tiers),
            **extra,
        },
    }
