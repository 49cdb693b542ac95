"""Sizes in bytes: human-readable for reprs, logs and tables (``fmt_bytes``), and
read from configs and the command line (``parse_size``)."""

from __future__ import annotations

import re
from fractions import Fraction

#: Byte units ``parse_size`` takes, lower-cased: binary (KiB or Ki = 2**10) and decimal (KB = 10**3).
SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "ki": 1 << 10,  # Kubernetes' spellings of the binary units
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
#: Unit spellings some tools read as binary and others as decimal: refused, with both readings.
_AMBIGUOUS = {"k": "KiB or KB", "m": "MiB or MB", "g": "GiB or GB", "t": "TiB or TB"}
#: Longest size string read (a longer one is refused, not parsed).
MAX_SIZE_CHARS = 64
_SIZE = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,2})?)\s*([A-Za-z]*)\s*")


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(text: str) -> int:
    """``"64GiB"`` -> ``68719476736``: a whole number of bytes, from digits and an
    optional unit (B, KiB/MiB/GiB/TiB or Ki/Mi/Gi/Ti, KB/MB/GB/TB; any case; ``"1.5 GiB"``
    and ``"1e9"``, which YAML reads as a string, too).
    Raises ``ValueError`` saying what is wrong; a bare ``K``/``M``/``G``/``T`` (binary
    to some tools, decimal to others) is refused rather than guessed."""
    m = _SIZE.fullmatch(text) if len(text) <= MAX_SIZE_CHARS else None
    if m is None:
        raise ValueError(f"must be a size such as 65536, '512MiB' or '64GiB'; got {text[:MAX_SIZE_CHARS]!r}")
    number, unit = m.group(1), m.group(2).lower()
    if unit in _AMBIGUOUS:
        raise ValueError(f"size unit {m.group(2)!r} is ambiguous: write {_AMBIGUOUS[unit]}; got {text!r}")
    scale = SIZE_UNITS.get(unit or "b")
    if scale is None:
        units = "B, KiB, MiB, GiB, TiB (or Ki, Mi, Gi, Ti), KB, MB, GB, TB"
        raise ValueError(f"unknown size unit {m.group(2)!r} (allowed: {units}); got {text!r}")
    size = Fraction(number) * scale
    if size.denominator != 1:
        raise ValueError(f"must be a whole number of bytes; {text!r} is {float(size)!r} bytes")
    return int(size)
