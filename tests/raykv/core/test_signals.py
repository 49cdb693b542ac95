"""SIGTERM and SIGHUP stop a ``raykv`` command with its clean-up, as Ctrl-C does
(``raykv.core.signals``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from raykv.core import signals
from tests.waiting import wait_until


def test_inside_a_termination_signal_raises_and_the_old_handlers_come_back_after():
    from ray._private import ray_constants

    before = {sig: signal.getsignal(sig) for sig in signals.TERMINATION_SIGNALS}
    setting = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    for sig in signals.TERMINATION_SIGNALS:
        with pytest.raises(KeyboardInterrupt) as caught:
            with signals.termination_handled():
                assert ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER is True
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does to it
                signals.after_ray_init()
                os.kill(os.getpid(), sig)
                pytest.fail("the signal raised nothing")
        assert isinstance(caught.value, signals.Terminated)
        assert signals.received() == sig
        assert {s: signal.getsignal(s) for s in signals.TERMINATION_SIGNALS} == before
        assert ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER == setting


def test_outside_after_ray_init_leaves_the_handlers_alone():
    before = signal.getsignal(signal.SIGTERM)
    signals.after_ray_init()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Ray's unix sockets live under the temp dir: keep its path short (108-byte limit).
    path = Path(tempfile.mkdtemp(prefix="rks", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(root: int) -> set[int]:
    """Live processes under ``root`` (Ray's node processes and workers are its children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_bench_stopped_by_a_signal_cleans_up_and_exits_128_plus_it(short_tmp, sig):
    """``raykv bench dataplane`` runs an embedded two-process Ray cluster with raykv's
    services and writes under a temporary folder: a signal mid-run must leave none of
    it behind, print one line, and exit with 128 + the signal (no C++ stack dump)."""
    env = {**os.environ, "TMPDIR": str(short_tmp), "RAY_USAGE_STATS_ENABLED": "0"}
    args = ["bench", "dataplane", "--quick", "--no-vllm", "--no-cross-node", "--json", "--no-progress"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "raykv.ops.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def raykv_runs() -> set[int]:
            procs = _descendants(bench.pid)
            return procs if any(_cmdline(p).startswith("ray::DirectoryShard") for p in procs) else set()

        procs = wait_until(raykv_runs, timeout_s=120, what="the bench's Ray and raykv's directory shards")
        [workdir] = short_tmp.glob("raykv-bench-dataplane-*")
        bench.send_signal(sig)
        out, err = bench.communicate(timeout=90)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 128 + sig, err[-2000:]
    assert f"raykv: stopped by {signal.Signals(sig).name}" in err
    assert "received at time" not in err  # abseil's failure handler did not run
    assert out == ""  # no report for a run that did not finish
    assert not workdir.exists()
    wait_until(lambda: not {p for p in procs if _alive(p)}, timeout_s=30, what="the bench's Ray processes gone")
