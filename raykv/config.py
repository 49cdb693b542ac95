"""Typed, validated configuration. Every error names the field and what is allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raykv.validate import ConfigError, as_mapping, check_number, is_int, join, type_name

__all__ = ["ConfigError", "RaykvConfig", "describe_options", "opt", "parse_options"]


_REQUIRED = object()


def opt(
    default: Any = _REQUIRED,
    *,
    kind: type | tuple[type, ...],
    min: float | None = None,
    max: float | None = None,
    warn_above: float | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    doc: str = "",
) -> Any:
    """Declare a validated option on a config dataclass.

    Numbers are checked against ``min``/``max`` (NaN and infinity never pass);
    above ``warn_above`` a value is legal but logs one warning.
    """
    meta = {
        "kind": kind,
        "min": min,
        "max": max,
        "warn_above": warn_above,
        "choices": choices,
        "check": check,
        "doc": doc,
    }
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
    if isinstance(value, bool):
        if bool not in kinds:
            raise ConfigError(name, f"must be {_kind_name(kind)}, got bool {value!r}")
    elif float in kinds and is_int(value):
        value = float(value)
    elif int in kinds and is_int(value):
        value = int(value)
    if not isinstance(value, kinds):
        raise ConfigError(name, f"must be {_kind_name(kind)}, got {type_name(value)} {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        check_number(name, value, minimum=meta.get("min"), maximum=meta.get("max"), warn_above=meta.get("warn_above"))
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
    raw = as_mapping(raw, where)
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(join(where, unknown[0]), f"unknown key; allowed keys: {allowed}")
    values = {}
    for name, f in fields.items():
        full = join(where, name)
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


#: Longest raykv namespace: it names Ray actors and metrics series.
MAX_NAMESPACE_CHARS = 128


def check_namespace(value: str) -> str | None:
    """What is wrong with a Ray namespace name (None: nothing)."""
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        return "must be non-empty letters, digits, '-', '_' or '.'"
    if len(value) > MAX_NAMESPACE_CHARS:
        return f"must be at most {MAX_NAMESPACE_CHARS} characters; got {len(value)} ({value[:20]!r}...)"
    return None


def namespace_option() -> Any:
    """A tier's ``namespace`` option (the raykv services it attaches to)."""
    return opt("raykv", kind=str, check=check_namespace, doc="Ray namespace of raykv (when no services are given)")


@dataclass
class RaykvConfig:
    """Cluster-wide raykv settings (what `raykv start` and `raykv.attach` use)."""

    namespace: str = opt("raykv", kind=str, check=check_namespace, doc="Ray namespace of the raykv actors")
    directory_shards: int = opt(2, kind=int, min=1, max=1024, warn_above=64, doc="number of directory shard actors")
    policy_refresh_s: float = opt(
        5.0, kind=float, min=0.05, max=3600.0, doc="long-poll period of engine-side policy caches"
    )
    lookup_ttl_s: float = opt(
        2.0, kind=float, min=0.0, max=3600.0, warn_above=60.0, doc="how long an engine trusts a directory answer"
    )
    # DESIGN.md's rule is that the scheduler thread never waits on I/O; this is
    # the one bounded exception, at a request's first lookup. `raykv bench e2e`
    # (README) measured it: one fewer engine step per promoted request.
    lookup_wait_ms: float = opt(
        5.0,
        kind=float,
        min=0.0,
        max=1000.0,
        doc="at a request's first lookup, how long the engine waits for the one directory call that resolves "
        "the request's whole prefix (answered in time: HIT/MISS in that step; else RETRY, answered next step). "
        "It waits only while its recent directory round trips fit in this (one probe a second otherwise); "
        "0: never wait (the prefix still goes in one call)",
    )
    # A RETRY holds a request back one engine step; one is normal (its keys are
    # asked at the end of the step, answered in a round trip of ~1 ms). 50 ms is
    # tens of round trips even on a loaded host and a few decode steps; past it the
    # directory is not answering in time, and prefilling a 1k-token prefix costs
    # about that (130 ms here for the 20M realistic-ratio model, tens of ms on a
    # GPU for 8B), so waiting longer costs the request more than computing.
    lookup_retry_budget_ms: float = opt(
        50.0,
        kind=float,
        min=0.0,
        max=60_000.0,
        doc="how long a request may be held back by RETRY answers (its directory answer not back yet) in a run "
        "of consecutive lookup rounds; past it, its still-unknown keys answer MISS and it computes them "
        "(counted in raykv_lookup_retry_budget_misses); 0: never RETRY",
    )
    lookup_cache_entries: int = opt(
        131_072,
        kind=int,
        min=1,
        doc="most directory answers (and most queued lookups) one engine process keeps; least recently used go first",
    )
    holder_reconcile_s: float = opt(
        5.0,
        kind=float,
        min=0.0,
        max=3600.0,
        doc="seconds between a tier actor's check that each directory shard lists exactly its keys "
        "(one count per shard; a shard that differs twice in a row gets the full listing); 0 = off",
    )
    status_log_s: float = opt(
        30.0,
        kind=float,
        min=0.0,
        doc="seconds between the one-line live status each raykv actor logs (the Ray dashboard shows it "
        "under the actor's Logs; logged only when it changed); 0 = off",
    )
    tiers: list = opt([], kind=list, doc="tier configs ({'type': ..., ...}) started with `raykv start`")
    rules: list = opt([], kind=list, doc="policy rules registered at start")
    shared_tenants: dict = opt(
        {},
        kind=dict,
        doc="tenants that share KV blocks (opt-in; by default every tenant named by kv_transfer_params['tenant'] "
        "sees only its own blocks): {'team-x': ['tenant-a', 'tenant-b']} shares within each group, "
        "{'public': ['*']} makes every tenant not in another group share with all. Shared prompt caches leak "
        "prompts through timing (CVE-2025-46570): share only between tenants that trust each other",
    )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "RaykvConfig":
        """Validate ``raw`` (fields, each tier and rule, and how they fit together)."""
        cfg = parse_options(cls, raw, "")
        from raykv.factory import tier_instance_key, validate_tier_config
        from raykv.policy import PolicyRule, check_rule_tier

        seen: dict[Any, int] = {}
        for i, tier in enumerate(cfg.tiers):
            where = f"tiers[{i}]"
            validate_tier_config(tier, where)
            ns = tier.get("namespace")
            if ns is not None and ns != cfg.namespace:
                raise ConfigError(
                    f"{where}.namespace",
                    f"{ns!r} differs from the config's namespace {cfg.namespace!r}; "
                    "leave it out (tiers use the config's namespace)",
                )
            key = tier_instance_key(tier, where)
            if key in seen:
                raise ConfigError(
                    where,
                    f"duplicate of tiers[{seen[key]}] (same {key[0]} tier"
                    + (f" {key[1]!r}" if key[1] else "")
                    + "); list each tier once",
                )
            seen[key] = i
        from raykv.tenants import check_shared_tenants

        check_shared_tenants(cfg.shared_tenants)
        types = [t["type"] for t in cfg.tiers]
        names: dict[str, int] = {}
        for i, raw_rule in enumerate(cfg.rules):
            rule = PolicyRule.from_dict(raw_rule, f"rules[{i}]")
            check_rule_tier(rule.tier, f"rules[{i}].tier", types or None)
            if rule.name:
                if rule.name in names:
                    raise ConfigError(
                        f"rules[{i}].name", f"{rule.name!r} is already the name of rules[{names[rule.name]}]"
                    )
                names[rule.name] = i
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
