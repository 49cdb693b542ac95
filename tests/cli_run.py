"""Run the ``raykv`` command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def _command(args: tuple[str, ...], namespace: str | None, address: str | None) -> list[str]:
    extra = [*(("--namespace", namespace) if namespace else ()), *(("--address", address) if address else ())]
    return [sys.executable, "-m", "raykv.ops.cli", *args, *extra]


def _env(env: dict[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` over it (a None value unsets the name)."""
    merged = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    return {k: v for k, v in merged.items() if v is not None}


def run_raykv(
    *args: str,
    namespace: str | None = None,
    address: str | None = None,
    env: dict[str, str | None] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``raykv ARGS [--namespace N] [--address A]``: its exit code, stdout and stderr
    (``env``: names set, or unset with None, beyond this process's environment)."""
    return subprocess.run(
        _command(args, namespace, address), capture_output=True, text=True, timeout=timeout, env=_env(env)
    )


def spawn_raykv(*args: str, namespace: str | None = None, address: str | None = None) -> subprocess.Popen:
    """``raykv ARGS`` started, not waited for (``communicate()`` gives its stdout and stderr)."""
    return subprocess.Popen(
        _command(args, namespace, address),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(None),
    )
