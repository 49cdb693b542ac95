"""Put raykv's Grafana dashboard where Ray's own Grafana provisioning finds it.

Ray's dashboard (on the head node) writes Grafana provisioning into
``<session dir>/metrics/grafana/``: a file provider (folder "Ray") that loads
every dashboard JSON in ``metrics/grafana/dashboards/`` (or
``$RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR``). A Grafana started with Ray's
``grafana.ini`` therefore shows raykv's dashboard next to Ray's once
``raykv_grafana_dashboard.json`` lies in that folder. Ray recreates the folder
when its dashboard restarts; ``raykv start`` (any run) writes the file again.
"""

from __future__ import annotations

import logging
import os
from importlib import resources

import ray

logger = logging.getLogger(__name__)

DASHBOARD_FILE = "raykv_grafana_dashboard.json"
_HEAD_RESOURCE = "node:__internal_head__"


def dashboard_json() -> str:
    """The dashboard shipped with raykv (``cluster_configs/grafana_raykv.json``)."""
    return resources.files("raykv").joinpath("grafana_raykv.json").read_text()


def dashboards_dir(session_dir: str) -> str:
    """The folder Ray's Grafana provisioning loads dashboards from."""
    return os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR") or os.path.join(
        session_dir, "metrics", "grafana", "dashboards"
    )


def write_dashboard(directory: str) -> str | None:
    """Write the dashboard into ``directory``; None when it does not exist (Ray runs without its dashboard)."""
    if not os.path.isdir(directory):
        return None
    path = os.path.join(directory, DASHBOARD_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(dashboard_json())
    os.replace(tmp, path)
    return path


def _local_session_dir() -> str:
    """This Ray session's directory on this node: ``<temp dir>/<session name>``.

    Ray 2.60 has no public call that returns the session directory itself (only its
    private node object does); it builds it as ``os.path.join(temp_dir, session_name)``,
    and both parts are public ``RuntimeContext`` calls. Not ``<temp dir>/session_latest``:
    that link names the newest session on the node, which need not be this one.
    """
    ctx = ray.get_runtime_context()
    return os.path.join(ctx.get_temp_dir(), ctx.get_session_name())


@ray.remote(num_cpus=0, resources={_HEAD_RESOURCE: 0.001})
def _provision_on_head() -> str | None:
    return write_dashboard(dashboards_dir(_local_session_dir()))


def provision(timeout_s: float = 30.0) -> str | None:
    """Write the dashboard on the head node; returns its path (None: no Ray dashboard, or it failed).

    From a process on the head node the file is written directly; elsewhere a
    zero-CPU task on the head node writes it.
    """
    try:
        me = ray.get_runtime_context().get_node_id()
        head = next(
            (n["NodeID"] for n in ray.nodes() if n.get("Alive", n.get("alive")) and _HEAD_RESOURCE in n["Resources"]),
            None,
        )
        if head is None:
            return None
        if head == me:
            path = write_dashboard(dashboards_dir(_local_session_dir()))
        else:
            path = ray.get(_provision_on_head.remote(), timeout=timeout_s)
    except Exception as e:  # a dashboard is a convenience: never fail raykv's start for it
        logger.warning("raykv's Grafana dashboard not provisioned: %r", e)
        return None
    if path:
        logger.info("raykv's Grafana dashboard provisioned at %s", path)
    return path
