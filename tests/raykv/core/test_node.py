"""Which node an engine process records (``raykv.core.node.process_node_id``) on a
two-node ``ray.cluster_utils.Cluster`` on this host.

A Ray actor on the second node plays the Serve LLM replica: raykv's vLLM plugin runs
in it and it spawns a plain Python process, the engine, that joins Ray through
``RAY_ADDRESS`` as Serve LLM's engine processes do. Ray connects such a process to the
head's raylet (several raylets share the host), so the engine takes its node from what
the plugin noted in the replica. A noted node that is not an alive node of the cluster
is ignored. (``tests/raykv/serve/test_router.py`` checks the same with real replicas.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from raykv.core.node import process_node_id
from raykv.integrations.vllm import plugin
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MIB = 1 << 20

#: The engine process: joins Ray as raykv's tiers do, runs the plugin as vLLM does there.
ENGINE = """
import json, ray
from raykv.core.node import process_node_id
from raykv.services.cluster import ensure_ray
from raykv.integrations.vllm import plugin
ensure_ray()
plugin.register()
print(json.dumps({"ray": ray.get_runtime_context().get_node_id(), "raykv": process_node_id()}))
"""


@pytest.fixture(scope="module")
def cluster(make_ray_cluster) -> Cluster:
    c, _ = make_ray_cluster(
        head={"num_cpus": 1, "object_store_memory": 128 * MIB},
        workers=[{"num_cpus": 1, "object_store_memory": 128 * MIB, "resources": {"node_b": 1}}],
    )
    return c


@ray.remote(num_cpus=0, resources={"node_b": 0.01})
class Replica:
    def spawn_engine(self, address: str) -> dict[str, Any]:
        plugin.register()  # vLLM runs its general plugins here before it spawns the engine
        env = dict(os.environ, RAY_ADDRESS=address)
        out = subprocess.run([sys.executable, "-c", ENGINE], env=env, capture_output=True, text=True, timeout=180)
        return {
            "replica": ray.get_runtime_context().get_node_id(),
            "noted": os.environ.get(plugin.NODE_ENV),
            "rc": out.returncode,
            "stdout": out.stdout,
            "stderr": out.stderr[-3000:],
        }


def _node_of(cluster: Cluster, resource: str) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def test_an_engine_spawned_by_a_replica_records_the_replica_node(cluster) -> None:
    node_b = _node_of(cluster, "node_b")
    got = ray.get(Replica.remote().spawn_engine.remote(cluster.address), timeout=240)
    assert got["rc"] == 0, got["stderr"]
    assert got["replica"] == node_b and got["noted"] == node_b
    engine = json.loads(got["stdout"].strip().splitlines()[-1])
    print(f"engine process: Ray connected it to node {engine['ray'][:12]}, raykv records {engine['raykv'][:12]}")
    assert engine["raykv"] == node_b


def test_a_driver_notes_no_node(cluster, monkeypatch) -> None:
    """The plugin notes a node in Ray workers only: a driver's may be the head's."""
    monkeypatch.delenv(plugin.NODE_ENV, raising=False)
    plugin.register()
    assert plugin.NODE_ENV not in os.environ
    assert process_node_id() == ray.get_runtime_context().get_node_id()


def test_a_noted_node_that_is_not_alive_here_is_ignored(cluster, monkeypatch) -> None:
    connected = ray.get_runtime_context().get_node_id()
    monkeypatch.setenv(plugin.NODE_ENV, "ab" * 28)  # no node of this cluster
    assert process_node_id() == connected
    gone = cluster.add_node(num_cpus=0, object_store_memory=80 * MIB, resources={"node_c": 1})
    cluster.wait_for_nodes()
    node_c = _node_of(cluster, "node_c")
    cluster.remove_node(gone)
    wait_until(
        lambda: not any(n["NodeID"] == node_c and n["Alive"] for n in ray.nodes()),
        timeout_s=60,
        interval_s=0.2,
        what="the removed node to be reported dead",
    )
    monkeypatch.setenv(plugin.NODE_ENV, node_c)  # a node that left
    assert process_node_id() == connected
    monkeypatch.setenv(plugin.NODE_ENV, _node_of(cluster, "node_b"))  # an alive node on this host
    assert process_node_id() == _node_of(cluster, "node_b")
