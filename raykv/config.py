"""Typed, validated configuration. Every error names the field and what is allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


_REQUIRED = object()


def opt(
    default: Any = _REQUIRED,
    *,
    kind: type | tuple[type, ...],
    min: float | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    doc: str = "",
) -> Any:
    """Declare a validated option on a config dataclass."""
    meta = {"kind": kind, "min": min, "choices": choices, "check": check, "doc": doc}
    if default is _REQUIRED:
        return field(default=None, metadata={**meta, "required": True})
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _check_value(name: str, value: Any, meta: Mapping[str, Any]) -> Any:
    kind = meta["kind"]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(name, f"must be {_kind_name(kind)}, got bool {value!r}")
    if not isinstance(value, kinds):
        raise ConfigError(name, f"must be {_kind_name(kind)}, got {type(value).__name__} {value!r}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(name, f"must be >= {meta['min']}, got {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(name, f"must be one of {allowed}; got {value!r}")
    if meta.get("check") is not None:
        problem = meta["check"](value)
        if problem:
            raise ConfigError(name, problem)
    return value


def parse_options(schema: type, raw: Mapping[str, Any] | None, where: str) -> Any:
    """Build the dataclass ``schema`` from ``raw``, validating every field.

    ``where`` prefixes field names in errors (e.g. ``secondary_tiers[1]``).
    """
    raw = dict(raw or {})
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(
            f"{where}.{unknown[0]}" if where else unknown[0],
            f"unknown key; allowed keys: {allowed}",
        )
    values = {}
    for name, f in fields.items():
        full = f"{where}.{name}" if where else name
        if name not in raw:
            if f.metadata.get("required"):
                raise ConfigError(full, f"required ({_kind_name(f.metadata['kind'])})")
            continue
        values[name] = _check_value(full, raw[name], f.metadata)
    return schema(**values)


def describe_options(schema: type) -> list[tuple[str, str, Any, str]]:
    """(name, kind, default, doc) of each option, for help texts."""
    out = []
    for f in dataclasses.fields(schema):
        default = "required" if f.metadata.get("required") else f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        out.append((f.name, _kind_name(f.metadata["kind"]), default, f.metadata.get("doc", "")))
    return out


def _check_namespace(value: str) -> str | None:
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        return "must be non-empty letters, digits, '-', '_' or '.'"
    return None


@dataclass
class RaykvConfig:
    """Cluster-wide raykv settings (what `raykv start` and `raykv.attach` use)."""

    namespace: str = opt("raykv", kind=str, check=_check_namespace, doc="Ray namespace of the raykv actors")
    directory_shards: int = opt(2, kind=int, min=1, doc="number of directory shard actors")
    policy_refresh_s: float = opt(
        5.0, kind=float, min=0.05, doc="long-poll period of engine-side policy caches"
    )
    lookup_ttl_s: float = opt(
        2.0, kind=float, min=0.0, doc="how long an engine trusts a directory answer"
    )
    status_log_s: float = opt(
        30.0,
        kind=float,
        min=0.0,
        doc="seconds between the one-line live status each raykv actor logs (the Ray dashboard shows it "
        "under the actor's Logs; logged only when it changed); 0 = off",
    )
    tiers: list = opt(
        [], kind=list, doc="tier configs ({'type': ..., ...}) started with `raykv start`"
    )
    rules: list = opt([], kind=list, doc="policy rules registered at start")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "RaykvConfig":
        cfg = parse_options(cls, raw, "")
        from raykv.factory import validate_tier_config
        from raykv.policy import PolicyRule

        for i, tier in enumerate(cfg.tiers):
            validate_tier_config(tier, f"tiers[{i}]")
        for i, rule in enumerate(cfg.rules):
            PolicyRule.from_dict(rule, f"rules[{i}]")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
