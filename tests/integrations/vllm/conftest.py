"""Fixtures shared by the vLLM integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

import raykv

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def two_node_raykv(request, vllm_env, make_ray_cluster) -> Iterator[tuple[Any, list[str]]]:
    """A two-node ``ray.cluster_utils.Cluster`` (2 CPUs, 256 MiB of plasma each)
    with raykv started in the test module's ``NAMESPACE``: (services, node ids)."""
    make_ray_cluster(
        head={"num_cpus": 2, "object_store_memory": 256 * MIB},
        workers=[{"num_cpus": 2, "object_store_memory": 256 * MIB}],
    )
    options = getattr(request.module, "RAYKV_OPTIONS", {})  # a module's own namespace options
    services = raykv.start({"namespace": request.module.NAMESPACE, "directory_shards": 2, **options})
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    yield services, nodes
    services.shutdown()
