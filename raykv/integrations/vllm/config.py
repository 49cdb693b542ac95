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


#: Module holding the vLLM adapters of raykv's tiers.
ADAPTER_MODULE = "raykv.integrations.vllm.tiers"
#: raykv tier type -> its vLLM adapter class (in ``ADAPTER_MODULE``).
ADAPTERS = {
    "object_store": "RaykvObjectStoreTier",
    "fs": "RaykvFsTier",
    "example": "RaykvExampleTier",
}
GENERIC_ADAPTER = "RaykvTier"


def vllm_tier_entry(tier: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    """vLLM's ``secondary_tiers`` entry for one (validated) raykv tier config."""
    options = {k: v for k, v in tier.items() if k not in ("type", "module_path")}
    if tier.get("module_path"):  # an out-of-tree raykv tier
        entry = {"type": GENERIC_ADAPTER, "raykv_type": tier["type"], "raykv_module_path": tier["module_path"]}
    else:
        entry = {"type": ADAPTERS[tier["type"]]}
    entry["module_path"] = ADAPTER_MODULE
    if namespace is not None and "namespace" not in options and _has_namespace_option(tier):
        options["namespace"] = namespace
    return {**entry, **copy.deepcopy(options)}


def _has_namespace_option(tier: dict[str, Any]) -> bool:
    from raykv.factory import TierFactory

    schema = getattr(TierFactory.get_tier_class(tier), "Options", None)
    return schema is not None and "namespace" in getattr(schema, "__dataclass_fields__", {})


def raykv_kv_transfer_config(
    config: Any = None,
    *,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
    vllm_tiers: list[dict[str, Any]] | None = None,
    ray_address: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for a raykv config (a ``RaykvConfig``, or its
    dict: ``{"namespace": ..., "tiers": [{"type": "object_store"}, {"type": "fs",
    "root": ...}]}``).

    The config is validated first (errors name the field and allowed values).
    Its tiers become vLLM ``secondary_tiers`` entries for raykv's adapters, in
    order (put ``object_store`` before ``fs``: vLLM promotes from the first
    tier that hits). ``vllm_tiers`` are vLLM-native tiers appended as given;
    ``ray_address`` tells the engine process which Ray cluster to join when it
    is not a Ray worker already.
    """
    from raykv.config import RaykvConfig

    cfg = config if isinstance(config, RaykvConfig) else RaykvConfig.from_dict(config or {})
    tiers = [vllm_tier_entry(t, cfg.namespace) for t in cfg.tiers]
    if ray_address:
        for t in tiers:
            t["ray_address"] = ray_address
    return kv_transfer_config([*tiers, *(vllm_tiers or [])], cpu_bytes=cpu_bytes, **extra)
