"""Fixtures shared by the tier tests."""

from __future__ import annotations

import pytest

import raykv


@pytest.fixture(scope="module")
def two_nodes(request, make_ray_cluster):
    """Two Ray nodes (resources ``node_a`` on the head, ``node_b``) with raykv
    started in the test module's ``NAMESPACE``."""
    make_ray_cluster(
        head={"num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 200 * 1024 * 1024},
        workers=[{"num_cpus": 1, "resources": {"node_b": 1}, "object_store_memory": 200 * 1024 * 1024}],
    )
    services = raykv.start({"namespace": request.module.NAMESPACE, "directory_shards": 2})
    yield services
    services.shutdown()
