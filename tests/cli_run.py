"""Run the ``raykv`` command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def run_raykv(
    *args: str,
    namespace: str | None = None,
    address: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``raykv ARGS [--namespace N] [--address A]``: its exit code, stdout and stderr."""
    extra = [*(("--namespace", namespace) if namespace else ()), *(("--address", address) if address else ())]
    return subprocess.run(
        [sys.executable, "-m", "raykv.ops.cli", *args, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})},
    )
