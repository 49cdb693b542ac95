"""The tests' one wait helper (tests/waiting.py): returns the predicate's value,
fails naming what it waited for and the last value seen."""

from __future__ import annotations

import time

import pytest

from tests.waiting import WaitTimeout, wait_until


def test_returns_the_first_truthy_value() -> None:
    values = iter([0, [], {"n": 3}])
    assert wait_until(lambda: next(values), timeout_s=5, interval_s=0, what="a value") == {"n": 3}


def test_fails_naming_what_and_the_last_value() -> None:
    calls = []
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as e:
        wait_until(lambda: calls.append(1) or len(calls) > 10**9, timeout_s=0.2, interval_s=0.05, what="a miracle")
    assert time.monotonic() - t0 >= 0.2
    assert isinstance(e.value, WaitTimeout) and e.value.last is False
    assert "a miracle" in str(e.value) and "last seen: False" in str(e.value)
    assert len(calls) >= 3  # asked again until the deadline, and once at it


def test_ignored_exceptions_count_as_not_yet() -> None:
    left = iter([ValueError("restarting"), ValueError("restarting"), "up"])

    def answer() -> str:
        v = next(left)
        if isinstance(v, Exception):
            raise v
        return v

    assert wait_until(answer, timeout_s=5, interval_s=0, ignore=(ValueError,), what="an answer") == "up"
    with pytest.raises(WaitTimeout, match="ValueError"):
        wait_until(lambda: int("x"), timeout_s=0.1, interval_s=0.02, ignore=(ValueError,), what="a number")
    with pytest.raises(KeyError):  # anything else ends the wait at once
        wait_until(lambda: {}["k"], timeout_s=5, what="a key")
