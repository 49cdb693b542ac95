"""Reading raykv's series back from the nodes' Prometheus endpoints (``raykv status``, tests)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


def parse_prometheus(text: str, prefix: str = "ray_raykv_") -> list[tuple[str, dict[str, str], float]]:
    """(series name, labels, value) of the raykv series in a metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out.append((sample.name, dict(sample.labels), float(sample.value)))
    return out


def scrape_node(
    host: str, port: int, timeout: float = 5.0, prefix: str = "ray_raykv_"
) -> list[tuple[str, dict[str, str], float]]:
    """The series named ``prefix...`` (raykv's by default) on one node's metrics export port."""
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode(), prefix)


def scrape_cluster(timeout: float = 5.0, prefix: str = "ray_raykv_") -> list[tuple[str, dict[str, str], float]]:
    """The series named ``prefix...`` (raykv's by default) of every alive node of the connected
    cluster (unreachable nodes skipped)."""
    import ray

    out: list[tuple[str, dict[str, str], float]] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            out += scrape_node(node["NodeManagerAddress"], int(port), timeout, prefix)
        except Exception as e:
            logger.debug("metrics of node %s unreadable: %r", node.get("NodeID"), e)
    return out


def sum_series(series: Iterable[tuple[str, dict[str, str], float]], name: str, by: str) -> dict[str, float]:
    """Sum of series ``name`` grouped by label ``by``."""
    out: dict[str, float] = {}
    for n, labels, value in series:
        if n == name:
            key = labels.get(by, "")
            out[key] = out.get(key, 0.0) + value
    return out
