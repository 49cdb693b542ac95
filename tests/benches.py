"""Running ``raykv bench`` from tests: a fresh process (each bench starts its own Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_bench(*args: str, timeout: float = 240) -> dict:
    """``raykv bench <args> --json --no-progress``'s JSON; fails the test on a non-zero exit."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "raykv.ops.cli", "bench", *args, "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_verdict(t: dict) -> None:
    """A target's ``passed`` is what its value, threshold and op say (None: not measured)."""
    assert t["op"] in (">=", "<="), t
    if t["value"] is None:
        assert t["passed"] is None, t
    else:
        ok = t["value"] >= t["threshold"] if t["op"] == ">=" else t["value"] <= t["threshold"]
        assert t["passed"] is ok, t
