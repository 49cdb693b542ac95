"""The tests' one way to wait for something: poll a predicate until it holds.

``from tests.waiting import wait_until`` (the repository root is on ``sys.path``:
``tests/conftest.py`` sees to it). A helper that waits for one particular thing
(a tier holding N keys, a node gone) is built on ``wait_until``; a bare
``time.sleep`` in a test is left only where the passing time is itself under
test (a TTL, a budget, paced traffic), with a comment saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_MISSING = object()


class WaitTimeout(AssertionError):
    """``wait_until`` ran out of time; ``last`` is the predicate's last value (or the
    last exception ``ignore`` let through)."""

    def __init__(self, message: str, last: Any) -> None:
        super().__init__(message)
        self.last = last


def _short(value: Any, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns a truthy value, and
    return that value. After ``timeout_s`` raise ``WaitTimeout`` (an
    ``AssertionError``: the test fails) naming ``what`` and the last value seen.
    Exceptions of the types in ``ignore`` count as "not yet" (e.g. an actor that is
    restarting); the predicate is always asked at least once, and once more at the
    deadline."""
    start = time.monotonic()
    deadline = start + timeout_s
    last: Any = _MISSING
    while True:
        try:
            value = predicate()
        except ignore as e:
            last = e
        else:
            if value:
                return value
            last = value
        now = time.monotonic()
        if now >= deadline:
            seen = "nothing (the predicate never returned)" if last is _MISSING else _short(last)
            raise WaitTimeout(
                f"timed out after {now - start:.1f} s (limit {timeout_s} s) waiting for {what}; last seen: {seen}",
                None if last is _MISSING else last,
            )
        time.sleep(min(interval_s, max(0.0, deadline - now)))
