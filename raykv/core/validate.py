"""One validation layer for everything a person types: config trees (dicts,
YAML/JSON files), CLI options, Python API arguments and per-request
``kv_transfer_params``.

Every rejection is a ``ConfigError`` (a ``ValueError``) whose ``field`` names
the config field or API argument (``tiers[1].root``, ``block_size``) and whose
message says what is allowed. Values that are legal but dangerous log one
warning per process (``warn_once``).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Mapping, Sequence, Sized
from typing import Any, Literal, TypeGuard, cast, overload

logger = logging.getLogger("raykv.core.validate")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        self.message = message
        super().__init__(f"{field_name}: {message}")


class ArgumentError(ConfigError):
    """A bad argument to a raykv API call; ``field`` is the argument's name."""


#: Name used for the whole of a config tree (its top level).
TOP = "config"

_warned: set[str] = set()


def warn_once(key: str, message: str) -> bool:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning(message)
    return True


def type_name(value: object) -> str:
    return type(value).__name__


def key_name(key: object) -> str:
    """How a mapping key appears in a field path: as is when it is a plain
    name (letters, digits, '_', '-'), else quoted (``''``, ``'a.b'``, ``1``)."""
    if isinstance(key, str) and key and all(c.isalnum() or c in "_-" for c in key) and key.isascii():
        return key
    return repr(key)


def join(where: str, name: object) -> str:
    """``where.name`` (or ``name`` at the top level), ``name`` as ``key_name`` shows it."""
    text = key_name(name)
    return f"{where}.{text}" if where else text


def as_mapping(raw: object, where: str, *, what: str = "a mapping") -> dict[str, object]:
    """``raw`` as a dict with str keys; ``None`` is an empty mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(where or TOP, f"must be {what}, got {type_name(raw)} {_short(raw)}")
    bad = [k for k in raw if not isinstance(k, str)]
    if bad:
        raise ConfigError(join(where, bad[0]), f"keys must be strings, got {type_name(bad[0])} {bad[0]!r}")
    return dict(raw)


def as_list(raw: object, where: str) -> list[Any]:
    """``raw`` as a list (a list or tuple; not a str, bytes or mapping).

    Its items are raw input, for the caller to check next (hence not typed)."""
    if isinstance(raw, (list, tuple)):
        return list(raw)
    raise ConfigError(where, f"must be a list, got {type_name(raw)} {_short(raw)}")


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """An integer (Python or numpy), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_number(
    where: str,
    value: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    warn_above: float | None = None,
) -> None:
    """Range checks for a number already of the right type: NaN and infinity
    are never allowed (``nan < min`` is False, so a bare ``<`` lets NaN in)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(where, f"must be a finite number, got {value!r}")
    if minimum is not None and not value >= minimum:
        raise ConfigError(where, f"must be >= {minimum}, got {value!r}")
    if maximum is not None and not value <= maximum:
        raise ConfigError(where, f"must be <= {maximum}, got {value!r}")
    if warn_above is not None and value > warn_above:
        warn_once(
            f"{where}>{warn_above}",
            f"raykv config {where}={value!r} is unusually large (above {warn_above}); is it a mistake?",
        )


def int_arg(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer API argument (Python or numpy int; not bool, float or str)."""
    if not is_int(value):
        raise ArgumentError(name, f"must be an int, got {type_name(value)} {_short(value)}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ArgumentError(name, f"must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ArgumentError(name, f"must be <= {maximum}, got {number}")
    return number


@overload
def timeout_arg(name: str, value: object, *, allow_none: Literal[False]) -> float: ...
@overload
def timeout_arg(name: str, value: object, *, allow_none: bool = True) -> float | None: ...
def timeout_arg(name: str, value: object, *, allow_none: bool = True) -> float | None:
    """A timeout in seconds: a finite number > 0 (or None: wait forever, where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(name, f"must be a number of seconds, got {type_name(value)} {_short(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ArgumentError(name, f"must be a finite number of seconds > 0, got {seconds!r}")
    return seconds


def sequence_arg(name: str, value: object) -> Sequence[object]:
    """A sequence of items (list, tuple, numpy array...); a str, bytes or mapping is not one."""
    if isinstance(value, (str, bytes, bytearray, memoryview, Mapping)) or not isinstance(value, Sized):
        raise ArgumentError(name, f"must be a sequence (list or tuple), got {type_name(value)} {_short(value)}")
    items = cast("Sequence[object]", value)  # sized; iterable is checked next: all its callers use of it
    try:
        iter(items)
    except TypeError:
        raise ArgumentError(name, f"must be a sequence (list or tuple), got {type_name(value)}") from None
    return items


def int_sequence_arg(name: str, value: object, *, minimum: int | None = None) -> list[int]:
    """A sequence of ints (chunk ids, token ids): floats and strings are refused, never coerced."""
    items = sequence_arg(name, value)
    dtype = getattr(items, "dtype", None)
    if dtype is not None and getattr(dtype, "kind", "") not in "iu":
        raise ArgumentError(name, f"must hold ints, got an array of {dtype}")
    return [int_arg(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(items)]


def json_value(where: str, value: object, depth: int = 0) -> None:
    """A JSON-like value (str, finite number, bool, None, list, str-keyed dict)."""
    if depth > 32:
        raise ConfigError(where, "nested too deeply (over 32 levels)")
    if value is None or isinstance(value, (str, bool)) or is_int(value):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(where, f"must be a finite number, got {value!r} (it never equals anything)")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            json_value(f"{where}[{i}]", v, depth + 1)
        return
    if isinstance(value, Mapping):
        for k, v in as_mapping(value, where).items():
            json_value(join(where, k), v, depth + 1)
        return
    raise ConfigError(where, f"must be a JSON value (str, number, bool, null, list, mapping), got {type_name(value)}")


def request_params(value: object) -> Mapping[str, object] | None:
    """A request's ``kv_transfer_params`` as raykv reads them: a mapping, or None.

    Requests are never refused for odd params (a cache must not fail a
    request): a falsy value is None, and anything that is not a mapping is
    ignored with one warning.
    """
    if not value:
        return None
    if isinstance(value, Mapping):
        return value
    warn_once(
        f"kv_transfer_params:{type_name(value)}",
        f"ignoring kv_transfer_params of type {type_name(value)} (raykv reads a mapping)",
    )
    return None


def request_tenant_value(value: object) -> str | None:
    """``kv_transfer_params['tenant']`` as a tenant name; None or ``""`` name no tenant.

    A str names itself and an int its digits. Any other value (a bool, a float,
    a list, a dict) still names a tenant, never none: it is scoped by its
    canonical JSON text, with one warning per type. A client that meant to keep
    its requests apart is then never put among the requests that name no tenant
    (where unsure, miss); requests that send the same odd value share a tenant.
    """
    if value is None or (isinstance(value, str) and not value):
        return None
    if isinstance(value, str) or is_int(value):
        return str(value)
    text = _canonical_text(value)
    warn_once(
        f"tenant:{type_name(value)}",
        f"kv_transfer_params['tenant'] of type {type_name(value)} (a tenant is a str) "
        f"is scoped as the tenant named by its JSON text, {_short(text)}",
    )
    return text


def _canonical_text(value: object) -> str:
    """``value`` as JSON with sorted keys and no spaces (``repr`` where JSON cannot say it)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):  # keys of mixed types, a circular list
        return repr(value)


#: Longest ``kv_transfer_params['cache_ttl_s']`` raykv keeps (7 days): a larger one is capped to it.
MAX_CACHE_TTL_S = 7 * 24 * 3600.0


def request_ttl_value(value: object) -> float | None:
    """``kv_transfer_params['cache_ttl_s']`` as seconds to pin a request's blocks, or None.

    A malformed TTL never fails the request (no odd ``kv_transfer_params`` do): a
    value that is not a finite number > 0 (a str, a bool, NaN, 0, -5) is
    ignored with one warning per kind of value, and the blocks are cached
    unpinned. A TTL above ``MAX_CACHE_TTL_S`` (7 days) is capped to it.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        warn_once(
            f"cache_ttl_s:{type_name(value)}",
            f"ignoring kv_transfer_params['cache_ttl_s'] of type {type_name(value)} (a number of seconds > 0)",
        )
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        warn_once(
            "cache_ttl_s:range",
            f"ignoring kv_transfer_params['cache_ttl_s']={seconds!r} (a finite number of seconds > 0)",
        )
        return None
    if seconds > MAX_CACHE_TTL_S:
        warn_once(
            "cache_ttl_s:max",
            f"kv_transfer_params['cache_ttl_s']={seconds!r} capped to {MAX_CACHE_TTL_S:.0f} s (7 days)",
        )
        return MAX_CACHE_TTL_S
    return seconds


def _short(value: object, limit: int = 60) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type_name(value)}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
