"""Tier factory: a lazy registry by ``type``, plus ``module_path`` for
out-of-tree tiers (the same convention as vLLM's ``SecondaryTierFactory``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from raykv.core.contract import SecondaryTier
from raykv.core.fields import parse_options
from raykv.core.identity import KVIdentity
from raykv.core.validate import ConfigError, as_mapping

# Keys every tier config may carry besides its own options.
COMMON_KEYS = ("type", "module_path", "identity")


class TierFactory:
    """Resolves tier configs (``{"type": ..., **options}``) to tier classes."""

    _registry: dict[str, Callable[[str], type[SecondaryTier]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``tier_type`` (imported on first use)."""
        if tier_type in cls._registry:
            raise ValueError(f"tier type {tier_type!r} is already registered")

        def load(where: str) -> type[SecondaryTier]:
            return _import_tier_class(module_path, class_name, f"{where}.type")

        cls._registry[tier_type] = load

    @classmethod
    def known_types(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def tier_type(cls, config: object, where: str = "tier") -> str:
        """``config``'s ``type`` (``ConfigError`` when ``config`` is no mapping or has none)."""
        tier_type = as_mapping(config, where, what="a mapping with a 'type' key").get("type")
        if not isinstance(tier_type, str) or not tier_type:
            raise ConfigError(f"{where}.type", f"required; known types: {', '.join(cls.known_types())}")
        return tier_type

    @classmethod
    def get_tier_class(cls, config: Mapping[str, object], where: str = "tier") -> type[SecondaryTier]:
        tier_type = cls.tier_type(config, where)
        module_path = config.get("module_path")
        if module_path is not None:
            if not isinstance(module_path, str) or not module_path:
                raise ConfigError(f"{where}.module_path", "must be a dotted module name")
            return _import_tier_class(module_path, tier_type, f"{where}.module_path")
        if tier_type not in cls._registry:
            raise ConfigError(
                f"{where}.type",
                f"unknown tier type {tier_type!r}; known types: {', '.join(cls.known_types())} "
                "(or give module_path for an out-of-tree tier)",
            )
        return cls._registry[tier_type](where)

    @classmethod
    def parse(cls, config: Mapping[str, object], where: str = "tier") -> tuple[type[SecondaryTier], object]:
        """Validate ``config``: the tier class and its parsed ``Options`` (the tier's own dataclass)."""
        tier_cls = cls.get_tier_class(config, where)
        if config.get("identity") is not None:
            KVIdentity.from_dict(config["identity"], f"{where}.identity")
        options = {k: v for k, v in config.items() if k not in COMMON_KEYS}
        schema = getattr(tier_cls, "Options", None)
        if schema is None:
            raise ConfigError(f"{where}.type", f"{tier_cls.__name__} declares no Options schema")
        return tier_cls, parse_options(schema, options, where)

    @classmethod
    def create_tier(
        cls, config: Mapping[str, object], primary_kv_view: memoryview, where: str = "tier", **kwargs: object
    ) -> SecondaryTier:
        """Validate ``config`` and build the tier over ``primary_kv_view`` (``kwargs``: the
        tier class's own, e.g. ``services``, ``identity``)."""
        tier_cls, options = cls.parse(config, where)
        if "identity" in config and "identity" not in kwargs:
            kwargs["identity"] = KVIdentity.from_dict(config["identity"], f"{where}.identity")
        # Every tier class takes (view, type, its Options, ...); SecondaryTier itself takes no options.
        build: Callable[..., SecondaryTier] = tier_cls
        return build(primary_kv_view, cls.tier_type(config, where), options, **kwargs)


def validate_tier_config(config: Mapping[str, object], where: str = "tier") -> object:
    """Raise ``ConfigError`` if ``config`` is not a valid tier config; its parsed ``Options``."""
    return TierFactory.parse(config, where)[1]


def tier_instance_key(config: Mapping[str, object], where: str = "tier") -> tuple[str, object]:
    """What makes two tier configs the same tier: its type, plus what the
    tier class's ``instance_key(options)`` says (the fs tier: its canonical
    root, so two spellings of one root are one tier). Without one, a type is
    one tier per config."""
    tier_cls, options = TierFactory.parse(config, where)
    key_of = getattr(tier_cls, "instance_key", None)
    return TierFactory.tier_type(config, where), (key_of(options) if key_of is not None else config.get("module_path"))


def _import_tier_class(module_path: str, class_name: str, field: str) -> type[SecondaryTier]:
    try:
        module = importlib.import_module(module_path)
    except Exception as e:
        raise ConfigError(field, f"cannot import module {module_path!r} for tier class {class_name!r}: {e!r}") from e
    tier_cls = getattr(module, class_name, None)
    if tier_cls is None:
        raise ConfigError(field, f"module {module_path!r} has no tier class {class_name!r}")
    if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTier)):
        raise ConfigError(field, f"{module_path}.{class_name} is not a raykv.core.contract.SecondaryTier subclass")
    return tier_cls


TierFactory.register_tier("example", "tiers.example", "ExampleTier")
TierFactory.register_tier("example_node", "tiers.example.node", "ExampleNodeTier")
TierFactory.register_tier("object_store", "tiers.object_store", "ObjectStoreTier")
TierFactory.register_tier("fs", "tiers.fs", "FsTier")
