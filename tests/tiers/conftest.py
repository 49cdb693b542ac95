"""Fixtures shared by the tier tests."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

import raykv


@pytest.fixture(scope="module")
def two_nodes(request):
    """Two Ray nodes (resources ``node_a`` on the head, ``node_b``) with raykv
    started in the test module's ``NAMESPACE``."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node_a": 1},
            "object_store_memory": 200 * 1024 * 1024,
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=200 * 1024 * 1024)
    ray.init(address=cluster.address, log_to_driver=False)
    services = raykv.start({"namespace": request.module.NAMESPACE, "directory_shards": 2})
    yield services
    services.shutdown()
    ray.shutdown()
    cluster.shutdown()
