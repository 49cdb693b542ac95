"""Typed option fields: ``opt`` declares one (default, kind, bounds, doc), ``parse_options``
checks a mapping against a dataclass of them, naming the field and the allowed values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Any

from raykv.core.validate import ConfigError, as_mapping, check_number, is_int, join, type_name

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
