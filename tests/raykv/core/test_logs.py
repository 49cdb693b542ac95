"""RAYKV_LOG_LEVEL: raykv's debug lines reach stderr in any process that imports raykv."""

from __future__ import annotations

import os
import subprocess
import sys

SNIPPET = "import logging, raykv; logging.getLogger('raykv.engine.pending').debug('decision inputs 42')"


def _run(level: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAYKV_LOG_LEVEL"}
    if level is not None:
        env["RAYKV_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=120)


def test_debug_lines_reach_stderr_when_asked() -> None:
    done = _run("DEBUG")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "decision inputs 42" in line]
    assert len(lines) == 1 and "raykv.engine.pending DEBUG" in lines[0]


def test_without_the_variable_debug_lines_are_dropped() -> None:
    done = _run(None)
    assert done.returncode == 0, done.stderr
    assert "decision inputs 42" not in done.stderr


def test_a_bad_level_is_named_and_ignored() -> None:
    done = _run("chatty")
    assert done.returncode == 0, done.stderr
    assert "RAYKV_LOG_LEVEL='chatty' ignored: allowed values are debug, info, warning, error" in done.stderr
    assert "decision inputs 42" not in done.stderr


def test_a_repeating_warning_is_logged_once_per_period_with_the_count_between(caplog) -> None:
    import logging

    from raykv.core.logs import Throttled

    clock = [100.0]
    throttled = Throttled(logging.getLogger("raykv.test.throttled"), period_s=10.0, clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="raykv.test.throttled"):
        assert throttled.warning("lookup failed: %r", "A")
        assert not throttled.warning("lookup failed: %r", "B")
        assert not throttled.warning("lookup failed: %r", "C")
        assert throttled.warning("another problem")  # each message has its own period
        clock[0] += 10.0
        assert throttled.warning("lookup failed: %r", "D")
    assert [r.getMessage() for r in caplog.records] == [
        "lookup failed: 'A'",
        "another problem",
        "lookup failed: 'D' (and 2 more like it since the last report)",
    ]
