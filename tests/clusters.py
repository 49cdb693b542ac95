"""The tests' one way to start Ray on this host: a local one, or a multi-node cluster.

``start_local_ray(**init)`` starts a single-node local Ray (no dashboard, no log
forwarding, unless ``init`` says so) after shutting down any Ray this process was
connected to; modules whose Ray needs settings of its own (a runtime env, system
config) use it, and the others share ``tests/conftest.py``'s ``ray_local``.

``ray_cluster(head=..., workers=...)`` starts a ``ray.cluster_utils.Cluster``
(the head with ``head``'s node arguments, one ``add_node`` per entry of
``workers``), connects this driver to it and, on exit, disconnects and tears
the cluster down. Modules use it through the ``make_ray_cluster`` fixture of
``tests/conftest.py`` (module scope), passing the node counts, resources and
object-store sizes they were tuned for::

    @pytest.fixture(scope="module")
    def cluster(make_ray_cluster):
        c, _ = make_ray_cluster(
            head={"num_cpus": 1, "object_store_memory": 128 * MIB},
            workers=[{"num_cpus": 1, "object_store_memory": 128 * MIB, "resources": {"node_b": 1}}],
        )
        yield c
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import ray
from ray.cluster_utils import Cluster


class RayCluster(NamedTuple):
    cluster: Cluster
    #: what ``ray.init`` returned (``dashboard_url`` and the like)
    context: Any


def start_local_ray(**init: Any) -> Any:
    """Shut down any Ray this process is connected to, then ``ray.init(address="local",
    include_dashboard=False, log_to_driver=False, **init)``; what it returned."""
    if ray.is_initialized():
        ray.shutdown()
    return ray.init(**{"address": "local", "include_dashboard": False, "log_to_driver": False, **init})


@contextmanager
def ray_cluster(
    *,
    head: Mapping[str, Any],
    workers: Sequence[Mapping[str, Any]] = (),
    init: Mapping[str, Any] | None = None,
) -> Iterator[RayCluster]:
    """A ``Cluster`` of a head node (``head``: its ``head_node_args``; no dashboard
    unless ``include_dashboard`` says so) and one node per ``workers`` entry (the
    arguments of ``Cluster.add_node``), with this driver connected
    (``ray.init(address=..., log_to_driver=False, **init)``). A Ray this process
    was connected to before is shut down first."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head})
    try:
        for node in workers:
            cluster.add_node(**node)
        context = ray.init(address=cluster.address, **{"log_to_driver": False, **(init or {})})
        yield RayCluster(cluster, context)
    finally:
        ray.shutdown()
        cluster.shutdown()
