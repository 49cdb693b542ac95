"""Helpers shared by the benchmarks: statistics, targets, tables, progress, JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypedDict, TypeVar, final

from raykv.core.validate import ArgumentError, int_arg, timeout_arg
from raykv.core.wire import JsonValue, Report

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def median(xs: Sequence[float]) -> float:
    """Median, or NaN for no samples."""
    return float(statistics.median(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100, linear interpolation), NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


#: Two-sided 95% quantiles of Student's t by degrees of freedom (1-10, 15, 20, 30).
_T95 = dict(
    zip(
        (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 30),
        (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.13, 2.09, 2.04),
    )
)


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float] | None:
    """Geometric mean of paired ``ratios`` (each > 0) and its 95% interval, from a t
    interval on their logs; None for fewer than two. On a shared host the rounds of a
    paired line swing by a fifth: the interval says whether N rounds resolve a 5% line."""
    if len(ratios) < 2 or any(not (x > 0 and math.isfinite(x)) for x in ratios):
        return None
    logs = [math.log(x) for x in ratios]
    df = len(logs) - 1
    t = _T95[max(d for d in _T95 if d <= df)]  # the next lower tabulated df: never too narrow
    mean, half = statistics.fmean(logs), t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


T = TypeVar("T")
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def read_settled(read: Callable[[], T], settle_s: float, timeout_s: float, min_wait_s: float = 0.0) -> T:
    """``read()`` again every ``settle_s`` until two reads in a row agree, ``min_wait_s``
    after the first at least (figures Ray exports every few seconds, which may be 0);
    the last read when they have not agreed within ``timeout_s``."""
    start = time.monotonic()
    last = read()
    while time.monotonic() - start < timeout_s:
        time.sleep(settle_s)
        now = read()
        if now == last and time.monotonic() - start >= min_wait_s:
            return now
        last = now
    return last


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (NaN when nothing was timed)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` or None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


def size_label(nbytes: int) -> str:
    """64KiB, 512KiB, 2MiB..."""
    for unit, n in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= n and nbytes % n == 0:
            return f"{nbytes // n}{unit}"
    return f"{nbytes}B"


def names_option(option: str, value: str, allowed: Sequence[str], allow_empty: bool = False) -> list[str]:
    """A comma-separated option's names (``--configs a,b``); ``ValueError`` names the
    option and the allowed names for an unknown one (or for none, unless ``allow_empty``)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = set(names) - set(allowed)
    if unknown or not (names or allow_empty):
        raise ArgumentError(option, f"unknown {sorted(unknown)}; allowed: {', '.join(allowed)}")
    return names


def fill_defaults(args: object, full: Mapping[str, object], quick: Mapping[str, object]) -> None:
    """Give each option of ``full`` left unset (None: registered with ``default=None``)
    ``quick``'s value under ``--quick``, else ``full``'s: an option given on the command
    line wins over ``--quick`` (``--quick --replicas 3`` runs three replicas)."""
    chosen = quick if getattr(args, "quick", False) else full
    for key, value in full.items():
        if getattr(args, key, None) is None:
            setattr(args, key, chosen.get(key, value))


def bad_option(message: str) -> ArgumentError:
    """A benchmark option out of range: ``message`` is ``"--option: what is allowed"``.
    raykv's CLI reports it as bad input (one line, exit code 2), not as an unexpected error."""
    option, _, allowed = message.partition(": ")
    return ArgumentError(option, allowed)


def at_least(minimum: int, **options: int | None) -> None:
    """Each of ``options`` given (``--name`` spelled with underscores; None: not given)
    is an int of at least ``minimum`` (``raykv.core.validate.int_arg``)."""
    for name, value in options.items():
        if value is not None:
            int_arg(_flag(name), value, minimum=minimum)


def above_zero(**options: float | None) -> None:
    """Each of ``options`` given (``--name`` spelled with underscores; None: not given) is a
    finite number of seconds above 0 (``raykv.core.validate.timeout_arg``)."""
    for name, value in options.items():
        timeout_arg(_flag(name), value)


def counts_option(option: str, text: str, parse: Callable[[str], int] = int) -> list[int]:
    """The comma-separated counts of ``option`` (``text``), each read by ``parse`` and at least 1."""
    out: list[int] = []
    for item in text.split(","):
        try:
            value = parse(item.strip())
        except ValueError as e:
            why = f"{item.strip()!r} is not a count" if parse is int else str(e)
            raise ArgumentError(option, why) from None
        out.append(int_arg(option, value, minimum=1))
    return out


def _flag(name: str) -> str:
    """A Python keyword's command-line option: ``io_threads`` -> ``--io-threads``."""
    return "--" + name.replace("_", "-")


def target(name: str, value: float | None, threshold: float, higher_is_better: bool = True, detail: str = "") -> Report:
    """One target line: ``passed`` is None when the value could not be measured."""
    if value is None or value != value:
        passed = None
    else:
        passed = value >= threshold if higher_is_better else value <= threshold
    return {
        "target": name,
        "value": value,
        "threshold": threshold,
        "op": ">=" if higher_is_better else "<=",
        "passed": passed,
        "detail": detail,
    }


def machine() -> Report:
    """What the numbers were measured on."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * KiB
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "loadavg_1m": load,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def fmt(v: object, digits: int = 2) -> str:
    """A table cell."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1e4:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], title: str = "") -> str:
    """A plain-text table (first column left-aligned, the rest right-aligned)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()

    out = [title] if title else []
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def targets_table(targets: JsonValue | Sequence[Report]) -> str:
    """The targets (a list of `target` lines) with their measured values and pass/miss."""
    rows = []
    for line in targets if isinstance(targets, (list, tuple)) else []:
        t = section(line)
        verdict = "n/a" if t["passed"] is None else ("pass" if t["passed"] else "MISS")
        rows.append((t["target"], t["value"], f"{t['op']} {fmt(t['threshold'])}", verdict, t.get("detail", "")))
    return table(("target", "measured", "wanted", "result", "detail"), rows, title="Targets")


def as_json(x: object) -> JsonValue:
    """``x`` (nested dicts, lists, tuples of JSON scalars) as a JSON value: NaN becomes null."""
    if isinstance(x, float) and x != x:
        return None
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    if isinstance(x, dict):
        return {str(k): as_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [as_json(v) for v in x]
    raise TypeError(f"not a JSON value: {x!r}")


def to_json(result: Mapping[str, object]) -> str:
    """One JSON object (NaN becomes null)."""
    return json.dumps(as_json(result), indent=2)


def number(v: JsonValue) -> float | None:
    """A report's number (None when missing or not a number)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def num(v: JsonValue) -> float:
    """A report's number (NaN when missing or not a number: it formats as ``nan``)."""
    n = number(v)
    return float("nan") if n is None else n


def section(v: JsonValue) -> Report:
    """A report's nested object ({} when missing or not an object)."""
    return v if isinstance(v, dict) else {}


def entries(v: JsonValue) -> list[JsonValue]:
    """A report's list ([] when missing or not a list)."""
    return v if isinstance(v, list) else []


class Tokenizer(Protocol):
    """What the benchmarks use of a Hugging Face tokenizer (``AutoTokenizer.from_pretrained``)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]: ...


def decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """The text of ``token_ids`` (one sequence: one string), special tokens left out."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert isinstance(text, str)
    return text


@final  # so that ``"error" in r`` tells a failure from a summary
class Failed(TypedDict):
    """A configuration (router, app set-up) that failed: what went wrong, in place of its figures."""

    error: str


class Progress:
    """A tqdm bar on stderr over a known number of steps (silent when disabled)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def step(self, what: str = "", n: int = 1) -> None:
        if self._bar is not None:
            if what:
                self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def random_keys(n: int, tag: bytes, key_bytes: int = 44) -> list[bytes]:
    """``n`` random identity-scoped keys of ``key_bytes`` (identity ``tag`` + random rest),
    as raykv stores vLLM's keys: an 8-byte tag, a 32-byte hash, a 4-byte group index."""
    step = key_bytes - len(tag)
    blob = os.urandom(n * step)
    return [tag + blob[i : i + step] for i in range(0, len(blob), step)]


def all_at_once(send: Callable[[_Item], _Result], items: Sequence[_Item]) -> list[_Result | BaseException]:
    """``send`` every item at the same moment (a thread each, released together by a
    barrier, as a burst of clients would); per item, its result or its error."""
    out: list[_Result | BaseException] = [RuntimeError("not sent")] * len(items)
    if not items:
        return out
    go = threading.Barrier(len(items))

    def one(i: int) -> None:
        go.wait()
        try:
            out[i] = send(items[i])
        except Exception as e:  # noqa: BLE001 - the caller reports it
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
