"""Fixtures shared by the vLLM integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

import raykv

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def two_node_raykv(request, vllm_env) -> Iterator[tuple[Any, list[str]]]:
    """A two-node ``ray.cluster_utils.Cluster`` (2 CPUs, 256 MiB of plasma each)
    with raykv started in the test module's ``NAMESPACE``: (services, node ids)."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": 256 * MIB, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, object_store_memory=256 * MIB)
    ray.init(address=cluster.address, log_to_driver=False)
    services = raykv.start({"namespace": request.module.NAMESPACE, "directory_shards": 2})
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    yield services, nodes
    services.shutdown()
    ray.shutdown()
    cluster.shutdown()
