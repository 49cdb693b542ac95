"""Typed option fields: ``opt`` declares one (default, kind, bounds, doc), ``parse_options``
checks a mapping against a dataclass of them, naming the field and the allowed values."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, overload

from raykv.core.units import parse_size
from raykv.core.validate import ConfigError, as_mapping, check_number, is_int, join, type_name

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
#: An options dataclass.
D = TypeVar("D", bound="DataclassInstance")
#: What ``opt`` accepts as a field's type: a class, or several.
Kind = type | tuple[type, ...]
#: An option's own check: what is wrong with a value already of its kind (None: nothing).
Check = Callable[..., "str | None"]
#: An option's reading of a value given in another form (a size string as bytes), before its
#: kind is checked; raises ``ValueError`` saying what is wrong.
Convert = Callable[[object], object]

_REQUIRED = object()


@overload
def opt(
    default: T,
    *,
    kind: Kind,
    min: float | None = None,
    max: float | None = None,
    warn_above: float | None = None,
    choices: Sequence[object] | None = None,
    check: Check | None = None,
    convert: Convert | None = None,
    doc: str = "",
) -> T: ...
@overload
def opt(
    *,
    kind: type[T],
    min: float | None = None,
    max: float | None = None,
    warn_above: float | None = None,
    choices: Sequence[object] | None = None,
    check: Check | None = None,
    convert: Convert | None = None,
    doc: str = "",
) -> T: ...
def opt(
    default: object = _REQUIRED,
    *,
    kind: Kind,
    min: float | None = None,
    max: float | None = None,
    warn_above: float | None = None,
    choices: Sequence[object] | None = None,
    check: Check | None = None,
    convert: Convert | None = None,
    doc: str = "",
) -> object:
    """Declare a validated option on a config dataclass (without ``default``: a required one).

    Numbers are checked against ``min``/``max`` (NaN and infinity never pass);
    above ``warn_above`` a value is legal but logs one warning. ``convert`` reads
    a value given in another form first (``size_value``: ``"64GiB"``). Like
    ``dataclasses.field`` it returns the field, typed as the option's value.
    """
    meta = {
        "kind": kind,
        "min": min,
        "max": max,
        "warn_above": warn_above,
        "choices": choices,
        "check": check,
        "convert": convert,
        "doc": doc,
    }
    if default is _REQUIRED:
        return field(default=None, metadata={**meta, "required": True})
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.copy, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class _Spec:
    """What ``opt`` noted of one option (a field's ``metadata``)."""

    kind: Kind
    min: float | None = None
    max: float | None = None
    warn_above: float | None = None
    choices: Sequence[object] | None = None
    check: Check | None = None
    convert: Convert | None = None
    doc: str = ""
    required: bool = False

    @classmethod
    def of(cls, f: dataclasses.Field[object]) -> _Spec:
        m = f.metadata
        return cls(
            m["kind"],
            m.get("min"),
            m.get("max"),
            m.get("warn_above"),
            m.get("choices"),
            m.get("check"),
            m.get("convert"),
            m.get("doc", ""),
            bool(m.get("required", False)),
        )


def _kind_name(kind: Kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _check_value(name: str, value: object, spec: _Spec) -> object:
    kind = spec.kind
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if spec.convert is not None:
        try:
            value = spec.convert(value)
        except ValueError as e:
            raise ConfigError(name, str(e)) from None
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
        check_number(name, value, minimum=spec.min, maximum=spec.max, warn_above=spec.warn_above)
    if spec.choices is not None and value not in spec.choices:
        allowed = ", ".join(repr(c) for c in spec.choices)
        raise ConfigError(name, f"must be one of {allowed}; got {value!r}")
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise ConfigError(name, problem)
    return value


def parse_options(schema: type[D], raw: Mapping[str, object] | None, where: str) -> D:
    """Build the dataclass ``schema`` from ``raw``, validating every field.

    ``where`` prefixes field names in errors (e.g. ``secondary_tiers[1]``).
    """
    given = as_mapping(raw, where)
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(none)"
        # a key named inside an allowed one ("shards" of "directory_shards"), else the closest spelling
        close = sorted((f for f in fields if unknown[0] in f or f in unknown[0]), key=len) or (
            difflib.get_close_matches(unknown[0], list(fields), n=1, cutoff=0.6)
        )
        meant = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(join(where, unknown[0]), f"unknown key; {meant}allowed keys: {allowed}")
    values = {}
    for name, f in fields.items():
        full = join(where, name)
        spec = _Spec.of(f)
        if name not in given:
            if spec.required:
                raise ConfigError(full, f"required ({_kind_name(spec.kind)})")
            continue
        values[name] = _check_value(full, given[name], spec)
    return schema(**values)


def describe_options(schema: type[DataclassInstance]) -> list[tuple[str, str, object, str]]:
    """(name, kind, default, doc) of each option, for help texts."""
    out: list[tuple[str, str, object, str]] = []
    for f in dataclasses.fields(schema):
        spec = _Spec.of(f)
        default: object = "required" if spec.required else f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append((f.name, _kind_name(spec.kind), default, spec.doc))
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


def check_ray_address(value: object) -> str | None:
    """What is wrong with a Ray address (None: nothing). Ray takes ``auto``,
    ``local``, ``host:port`` or a URI such as ``ray://host:10001``."""
    problem = f"must be a Ray address such as 'auto' or 'host:6379', got {value!r}"
    if not isinstance(value, str) or not value.strip():
        return problem
    if value in ("auto", "local") or "://" in value:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return problem
    return None


def size_value(value: object) -> object:
    """``convert`` for an option in bytes: a size string (``"64GiB"``, ``raykv.core.units.parse_size``)
    or a float with no fraction (``1e9``) as an int; anything else as it is (its kind check follows)."""
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, float):
        if not value.is_integer():  # NaN and infinity too
            raise ValueError(f"must be a whole number of bytes (an int, or a size such as '64GiB'); got {value!r}")
        return int(value)
    return value


def bytes_option(default: int, *, min: int, doc: str) -> int:
    """An option in bytes: an int, or a size string such as ``"64GiB"``."""
    return opt(default, kind=int, min=min, convert=size_value, doc=f"{doc} (an int, or a size such as '64GiB')")


def namespace_option() -> str:
    """A tier's ``namespace`` option (the raykv services it attaches to)."""
    return opt("raykv", kind=str, check=check_namespace, doc="Ray namespace of raykv (when no services are given)")
