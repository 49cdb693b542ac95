"""The cluster YAMLs' start commands under Ray token authentication, run on this machine.

`ray up` runs ``head_start_ray_commands`` on the head and ``worker_start_ray_commands``
on each worker; this runs both here, as a head and one worker node of one cluster, with
what a one-machine run must change (free ports, small object stores, one CPU each, no
dashboard, no autoscaler config, ``--block`` so that the test owns the processes,
the default raykv config in place of ``raykv.yaml``'s NFS root, and ``RAY_ADDRESS``
for ``raykv`` on the head, where other Rays may run). With a token in ``~/.ray/auth_token``
(the file the YAMLs' commented file mount copies to every node), the head turns token
authentication on and the worker's ``ray start`` must be told so: without
``RAY_AUTH_MODE=token`` Ray 2.60's ``ray start --address`` sends no token and is refused.
Without a token the same commands start a cluster with none.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.cli_run import run_raykv
from tests.waiting import wait_until

pytestmark = pytest.mark.long

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
BIN = str(Path(sys.executable).parent)


class OneMachineCluster:
    """A head and a worker started from a cluster YAML's commands, in a home of their own."""

    def __init__(self, home: Path, temp_dir: str, ports: Callable[[], int]) -> None:
        self.home = home
        self.raykv_config = home / "raykv.yaml"  # the YAMLs' raykv.yaml, sized for this machine
        self.temp_dir = temp_dir  # short: Ray's socket paths under it must fit in 107 bytes
        self.gcs = ports()
        self._ports = ports
        self._blocking: list[tuple[subprocess.Popen, Path]] = []  # each `ray start`, and its output
        self.token = False
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(HOME=str(home), PATH=f"{BIN}:{os.environ['PATH']}", RAY_HEAD_IP="127.0.0.1")
        self.env["RAY_USAGE_STATS_ENABLED"] = "0"

    def local(self, command: str) -> str:
        """A YAML command with the one-machine changes (see the module docstring)."""
        command = command.replace("6379", str(self.gcs))
        for flag in ("--metrics-export-port", "--object-manager-port"):
            command = re.sub(rf"{flag}=\d+", f"{flag}={self._ports()}", command)
        command = re.sub(r"--object-store-memory=\d+", "--object-store-memory=200000000", command)
        command = re.sub(r"--autoscaling-config=\S+", "", command)
        command = command.replace("--dashboard-host=0.0.0.0", "--include-dashboard=false")
        command = re.sub(r"--config \S+", f"--config {self.raykv_config}", command)
        return command.replace("ray start", f"ray start --num-cpus=1 --temp-dir={self.temp_dir}")

    def run(self, command: str) -> subprocess.CompletedProcess:
        """A start command: `ray start` blocks (the test stops it), `raykv` runs to its end."""
        command = self.local(command)
        if "ray start" in command:
            log = self.home / f"ray-start-{len(self._blocking)}.log"  # a file: a pipe nobody reads could fill
            with log.open("w") as out:
                proc = subprocess.Popen(
                    ["bash", "-c", command + " --block"],
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self._blocking.append((proc, log))
            # `ray start` returns once its node runs: so does this (the next command needs it)
            wait_until(
                lambda: self.alive_nodes() == len(self._blocking),
                timeout_s=90,
                what=f"{len(self._blocking)} node(s) alive after {command!r}",
            )
            return subprocess.CompletedProcess(command, 0)
        env = {**self.env, "RAY_ADDRESS": f"127.0.0.1:{self.gcs}"}
        return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)

    def alive_nodes(self) -> int:
        """The cluster's alive nodes, asked by a Ray client (-1: it did not connect)."""
        failed = self.failed_start()
        assert failed is None, f"a `ray start` ended:\n{failed[-3000:]}"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", self.gcs)) != 0:
                return -1  # the head's GCS is not listening yet
        ask = "import ray; ray.init(address='{}'); print(sum(n['Alive'] for n in ray.nodes()))"
        try:
            out = subprocess.run(
                [sys.executable, "-c", ask.format(f"127.0.0.1:{self.gcs}")],
                env={**self.env, **({"RAY_AUTH_MODE": "token"} if self.token else {})},
                capture_output=True,
                text=True,
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            return -1
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else -1

    def raykv(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        """``raykv ARGS --address HEAD`` in this cluster's environment (``env``: names set over it)."""
        unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("RAY_")}
        return run_raykv(*args, address=f"127.0.0.1:{self.gcs}", env={**unset, **self.env, **env})

    def failed_start(self) -> str | None:
        """The output of a `ray start` that exited (with --block, a start that ends failed)."""
        for proc, log in self._blocking:
            if proc.poll() is not None:
                return log.read_text()
        return None

    def write_raykv_config(self) -> None:
        """raykv.yaml with the fs root in the home (no NFS here) and a small object store tier."""
        doc = yaml.safe_load((CONFIGS / "raykv.yaml").read_text())
        for tier in doc["tiers"]:
            if tier["type"] == "fs":
                tier["root"] = str(self.home / "raykv-kv")
            if tier["type"] == "object_store":
                tier["capacity_bytes"] = "64MiB"
        self.raykv_config.write_text(yaml.safe_dump(doc))

    def stop(self) -> None:
        self.raykv("stop")
        for proc, _ in self._blocking:  # each `ray start` and what it started (a session of its own)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", self.temp_dir], capture_output=True)  # Ray workers, if any left


@pytest.fixture
def one_machine(tmp_path, free_port) -> Iterator[OneMachineCluster]:
    temp_dir = tempfile.mkdtemp(prefix="raykv-tok-", dir="/tmp")
    cluster = OneMachineCluster(tmp_path / "home", temp_dir, free_port)
    (cluster.home / ".ray").mkdir(parents=True)
    cluster.write_raykv_config()
    yield cluster
    cluster.stop()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _start_commands(doc: dict, key: str) -> list[str]:
    return [c for c in doc[key] if c != "ray stop"]  # `ray stop` here would stop every Ray on the machine


@pytest.mark.parametrize(
    ("name", "token"), [("onprem.yaml", True), ("aws.yaml", True), ("onprem.yaml", False)], ids=str
)
def test_the_yamls_start_a_head_and_a_worker_with_or_without_a_token(
    one_machine: OneMachineCluster, name: str, token: bool
) -> None:
    doc = yaml.safe_load((CONFIGS / name).read_text())
    assert "# ~/.ray/auth_token: ~/.ray/auth_token" in (CONFIGS / name).read_text(), "the token's file mount"
    if token:
        generated = subprocess.run(
            [f"{BIN}/ray", "get-auth-token", "--generate"], env=one_machine.env, capture_output=True, timeout=60
        )
        token_file = one_machine.home / ".ray" / "auth_token"
        assert generated.returncode == 0 and token_file.is_file()
        one_machine.token = True
        # The setup commands keep the copied token to its user (Ray 2.60 writes it 0644).
        for command in [c for c in doc["setup_commands"] if "auth_token" in c]:
            out = one_machine.run(command)
            assert out.returncode == 0, f"{command}:\n{out.stderr[-3000:]}"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600, oct(token_file.stat().st_mode)

    for command in _start_commands(doc, "head_start_ray_commands"):
        out = one_machine.run(command)
        assert out.returncode == 0, f"{command}:\n{out.stderr[-3000:]}"
    for command in _start_commands(doc, "worker_start_ray_commands"):
        out = one_machine.run(command)
        assert out.returncode == 0, f"{command}:\n{out.stderr[-3000:]}"

    status = one_machine.raykv("status", "--no-metrics")
    assert status.returncode == 0, status.stderr
    assert re.search(r"raykv-control\s+yes", status.stdout), status.stdout
    # The worker's raykv start (the YAML's own, with --address) started its node's object store tier.
    assert len(re.findall(r"^object_store\s+\S+\s+yes", status.stdout, re.MULTILINE)) == 2, status.stdout
    assert "Token authentication is enabled" not in status.stderr

    # Token mode is what the head chose: a client that sends no token is refused.
    refused = subprocess.run(
        [f"{BIN}/ray", "status", "--address", f"127.0.0.1:{one_machine.gcs}"],
        env={**one_machine.env, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (refused.returncode != 0) == token, refused.stdout[-2000:] + refused.stderr[-2000:]
    if token and name == "onprem.yaml":
        # raykv with the wrong token: an error that says the machine needs the head's token, not
        # "no Ray cluster reachable" (Ray retries the connection for about 20 s first).
        wrong = one_machine.raykv("status", "--no-metrics", RAY_AUTH_TOKEN="0" * 32)
        assert wrong.returncode != 0 and "Traceback" not in wrong.stderr, wrong.stderr[-3000:]
        assert "(its port answers)" in wrong.stderr and "`ray get-auth-token` on its head node" in wrong.stderr, (
            wrong.stderr[-3000:]
        )
