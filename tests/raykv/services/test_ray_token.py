"""A process of a cluster without token authentication, on a machine with a Ray token
(``~/.ray/auth_token``: Ray 2.60's local ``ray.init()`` writes one). raykv used to turn
token auth on for it whenever the file existed: the process connected, but the cluster's
calls to it carried no token, so every actor it created was destroyed at once (a vLLM
engine's engine-cache actor: the raykv router never saw the engine). The token path,
against a cluster with token auth, is ``tests/raykv/ops/test_status.py``'s explicit-address
run and ``tests/cluster_configs/test_token_auth.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from raykv.services.ray_token import cluster_requires_token
from tests.waiting import wait_until

BIN = Path(sys.executable).parent
#: What a vLLM engine process does with raykv tiers (``RaykvTier``): join the cluster as a
#: guest at an explicit address, then own an actor (its engine-cache actor).
ENGINE_LIKE = """
import sys, ray
from raykv.services.cluster import ensure_ray
ensure_ray(sys.argv[1], guest=True)

@ray.remote(num_cpus=0)
class Owned:
    def ping(self):
        return "pong"

print(ray.get(Owned.remote().ping.remote(), timeout=60))
"""


@pytest.fixture(scope="module")
def tokenless_cluster(tmp_path_factory, free_port) -> Iterator[tuple[str, dict[str, str]]]:
    """A head started with ``RAY_AUTH_MODE=disabled``, in a home whose ``~/.ray/auth_token``
    exists; yields its GCS address and the environment of a process on its machine."""
    home = tmp_path_factory.mktemp("tokenless-home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex)
    temp_dir = tempfile.mkdtemp(prefix="raykv-notok-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    port = free_port()
    log = home / "ray-start.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                f"--port={port}",
                "--num-cpus=1",
                "--include-dashboard=false",
                "--object-store-memory=100000000",
                f"--temp-dir={temp_dir}",
                "--block",
            ],
            env={**env, "RAY_AUTH_MODE": "disabled"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the test owns the head and what it starts
        )
    address = f"127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert head.poll() is None, log.read_text()[-3000:]
            return cluster_requires_token(address, timeout_s=1.0) is not None

        wait_until(up, timeout_s=90, interval_s=0.5, what="the head's GCS to answer")
        yield address, env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", temp_dir], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_cluster_without_token_auth_is_told_apart(tokenless_cluster) -> None:
    address, _ = tokenless_cluster
    assert cluster_requires_token(address) is False


@pytest.mark.parametrize("how", ["address", "RAY_ADDRESS"])
def test_an_engine_process_owns_actors_on_a_cluster_without_token_auth(tokenless_cluster, how: str) -> None:
    """The cluster named by its address, or by ``RAY_ADDRESS`` with ``auto`` (what
    ``ray.init`` then connects to). Before the fix: ``ActorDiedError`` ("all references
    to the actor were removed"). ``auto`` with no ``RAY_ADDRESS`` is left to Ray."""
    address, env = tokenless_cluster
    if how == "RAY_ADDRESS":
        env = {**env, "RAY_ADDRESS": address}
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_LIKE, address if how == "address" else "auto"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == ["pong"], out.stderr[-3000:]


def test_an_address_that_is_not_a_ray_cluster_cannot_tell() -> None:
    """A port that accepts and never answers: no verdict, within the probe's limit."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        host, port = silent.getsockname()
        assert cluster_requires_token(f"{host}:{port}", timeout_s=1.0) is None
