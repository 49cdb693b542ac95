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
