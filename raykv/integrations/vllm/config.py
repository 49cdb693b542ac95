"""Build vLLM's `kv_transfer_config` for raykv (no vLLM import needed)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from raykv.core.fields import check_ray_address, size_value
from raykv.core.validate import ArgumentError, ConfigError, as_list, int_arg, warn_once
from raykv.core.wire import JsonValue

if TYPE_CHECKING:
    from raykv.config.options import RaykvConfig

#: ``weights_fingerprint`` modes (``raykv.integrations.vllm.identity``; kept
#: here so building a config needs no vLLM).
FINGERPRINT_MODES = ("stat", "content", "none")

RAYKV_SPEC_NAME = "RaykvOffloadingSpec"
RAYKV_SPEC_MODULE = "raykv.integrations.vllm.spec"
DEFAULT_CPU_BYTES = 4 << 30
#: Below this a CPU primary is almost surely a typo (one block of a small model is ~1 MiB).
MIN_SENSIBLE_CPU_BYTES = 1 << 20

# Keys this builder owns; passing them through **extra would silently fight it.
_RESERVED = {"spec_name", "spec_module_path", "cpu_bytes_to_use", "secondary_tiers"}


def cpu_bytes_arg(value: object) -> int:
    """The CPU primary's size: an int of bytes, or a size string such as ``"8GiB"``."""
    try:
        number = size_value(value)
    except ValueError as e:
        raise ArgumentError("cpu_bytes", str(e)) from None
    if not isinstance(number, int) or isinstance(number, bool):
        raise ArgumentError(
            "cpu_bytes", f"must be an int or a size such as '8GiB', got {type(value).__name__} {value!r}"
        )
    return int_arg("cpu_bytes", number, minimum=1)


def kv_transfer_config(
    secondary_tiers: Sequence[Mapping[str, JsonValue]] | None = None,
    cpu_bytes: int | str = DEFAULT_CPU_BYTES,
    **extra: JsonValue,
) -> dict[str, JsonValue]:
    """The `kv_transfer_config` dict for `vllm.LLM(...)` / Ray Serve `engine_kwargs`.

    Args:
        secondary_tiers: tier configs, each `{"type": ..., ...}` (plus
            `"module_path"` for out-of-tree tiers); copied, never mutated.
        cpu_bytes: size of the CPU primary tier: bytes, or a size such as ``"8GiB"``
            (as in config files and ``raykv vllm-config --cpu-bytes``).
        **extra: other `kv_connector_extra_config` keys (e.g. `block_size`,
            `eviction_policy`, `backpressure`).
    """
    cpu_bytes = cpu_bytes_arg(cpu_bytes)
    if cpu_bytes < MIN_SENSIBLE_CPU_BYTES:
        warn_once(
            "cpu_bytes<1MiB",
            f"cpu_bytes={cpu_bytes} is less than 1 MiB, smaller than one KV block of most models "
            "(the engine refuses a CPU primary that holds no block)",
        )
    clash = sorted(_RESERVED & extra.keys())
    if clash:
        raise ArgumentError(clash[0], "set it through kv_transfer_config's own arguments")
    tiers = as_list(secondary_tiers, "secondary_tiers") if secondary_tiers is not None else []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict):
            raise ConfigError(f"secondary_tiers[{i}]", f"must be a dict, got {type(tier).__name__}")
        if not isinstance(tier.get("type"), str) or not tier["type"]:
            raise ConfigError(f"secondary_tiers[{i}].type", "must be a non-empty string")
        module_path = tier.get("module_path")
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ConfigError(f"secondary_tiers[{i}].module_path", "must be a non-empty string")
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


def check_primary_fits(cpu_bytes: object, kv_bytes_per_chunk: int, num_chunks: int) -> None:
    """A CPU primary must hold at least one KV chunk (what vLLM's spec computed
    for this model: ``num_chunks`` of ``kv_bytes_per_chunk`` bytes)."""
    if kv_bytes_per_chunk > 0 and num_chunks < 1:
        raise ConfigError(
            "cpu_bytes_to_use",
            f"{cpu_bytes} bytes is smaller than one KV block of this model ({kv_bytes_per_chunk} bytes); "
            f"give the CPU primary at least {kv_bytes_per_chunk} bytes (cpu_bytes), better many blocks",
        )


#: Module holding the vLLM adapters of raykv's tiers.
ADAPTER_MODULE = "raykv.integrations.vllm.tiers"
#: raykv tier type -> its vLLM adapter class (in ``ADAPTER_MODULE``).
ADAPTERS = {
    "object_store": "RaykvObjectStoreTier",
    "fs": "RaykvFsTier",
    "example": "RaykvExampleTier",
}
GENERIC_ADAPTER = "RaykvTier"


def vllm_tier_entry(tier: Mapping[str, JsonValue], namespace: str | None = None) -> dict[str, JsonValue]:
    """vLLM's ``secondary_tiers`` entry for one (validated) raykv tier config."""
    options = {k: v for k, v in tier.items() if k not in ("type", "module_path")}
    if tier.get("module_path"):  # an out-of-tree raykv tier
        entry: dict[str, JsonValue] = {
            "type": GENERIC_ADAPTER,
            "raykv_type": tier["type"],
            "raykv_module_path": tier["module_path"],
        }
    else:
        entry = {"type": ADAPTERS[str(tier["type"])]}
    entry["module_path"] = ADAPTER_MODULE
    if namespace is not None and "namespace" not in options and _has_namespace_option(tier):
        options["namespace"] = namespace
    return {**entry, **copy.deepcopy(options)}


def _has_namespace_option(tier: Mapping[str, JsonValue]) -> bool:
    from raykv.core.factory import TierFactory

    schema = getattr(TierFactory.get_tier_class(tier), "Options", None)
    return schema is not None and "namespace" in getattr(schema, "__dataclass_fields__", {})


def raykv_kv_transfer_config(
    config: RaykvConfig | Mapping[str, object] | None = None,
    *,
    cpu_bytes: int | str = DEFAULT_CPU_BYTES,
    vllm_tiers: Sequence[Mapping[str, JsonValue]] | None = None,
    ray_address: str | None = None,
    model_revision: str | None = None,
    weights_fingerprint: str | None = None,
    **extra: JsonValue,
) -> dict[str, JsonValue]:
    """vLLM's ``kv_transfer_config`` for a raykv config (a ``RaykvConfig``, or its
    dict: ``{"namespace": ..., "tiers": [{"type": "object_store"}, {"type": "fs",
    "root": ...}]}``).

    The config is validated first (errors name the field and allowed values).
    Its tiers become vLLM ``secondary_tiers`` entries for raykv's adapters, in
    order (put ``object_store`` before ``fs``: vLLM promotes from the first
    tier that hits). ``vllm_tiers`` are vLLM-native tiers appended as given;
    ``ray_address`` tells the engine process which Ray cluster to join when it
    is not a Ray worker already. ``model_revision`` and ``weights_fingerprint``
    (``stat``, ``content``, ``none``) feed the engine's KV identity
    (``raykv.integrations.vllm.identity``).
    """
    from raykv.config.options import RaykvConfig

    cfg = RaykvConfig.from_dict(config.to_dict() if isinstance(config, RaykvConfig) else config)
    tiers = [vllm_tier_entry(t, cfg.namespace) for t in cfg.tiers]
    address_problem = None if ray_address is None else check_ray_address(ray_address)
    if address_problem:
        raise ArgumentError("ray_address", address_problem)
    if ray_address:
        for t in tiers:
            t["ray_address"] = ray_address
    native = as_list(vllm_tiers, "vllm_tiers") if vllm_tiers is not None else []
    if not tiers and not native:
        warn_once(
            "raykv-no-tiers",
            f"the raykv config (namespace {cfg.namespace!r}) lists no tiers: each engine gets only its own CPU "
            "primary, and no block is shared across replicas or outlives its engine. Add tiers, for example "
            "tiers: [{type: object_store}, {type: fs, root: /mnt/shared/raykv}]",
        )
    if model_revision is not None:
        if not isinstance(model_revision, str) or not model_revision.strip():
            raise ArgumentError("model_revision", f"must be a non-empty str, got {model_revision!r}")
        extra["raykv_model_revision"] = model_revision
    if weights_fingerprint is not None:
        if weights_fingerprint not in FINGERPRINT_MODES:
            raise ArgumentError(
                "weights_fingerprint", f"must be one of {', '.join(FINGERPRINT_MODES)}; got {weights_fingerprint!r}"
            )
        extra["raykv_weights_fingerprint"] = weights_fingerprint
    return kv_transfer_config([*tiers, *native], cpu_bytes=cpu_bytes, **extra)
