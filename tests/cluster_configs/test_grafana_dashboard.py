"""Every panel of the Grafana dashboard queries metrics that raykv exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raykv import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster_configs" / "grafana_raykv.json"
# Series names in PromQL: identifiers followed by a selector, a range, a comma or ')'.
_NAME = re.compile(r"\b(ray_[a-zA-Z0-9_:]+)")


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        if p.get("type") == "row":
            yield from _panels(p.get("panels", []))
        else:
            yield p


def _names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def test_catalog_exported_names_follow_ray_naming() -> None:
    names = metrics.exported_names()
    assert "ray_raykv_lookups_total" in names  # counters get _total
    assert "ray_raykv_tier_bytes" in names  # gauges keep their name
    assert {"ray_raykv_job_latency_seconds_bucket", "ray_raykv_job_latency_seconds_count"} <= names
    assert all(n.startswith("ray_raykv_") for n in names)


def test_every_panel_queries_metrics_raykv_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = metrics.exported_names()
    panels = list(_panels(dash["panels"]))
    assert len(panels) >= 10
    used: set[str] = set()
    for panel in panels:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        names = set().union(*(_names(e) for e in exprs))
        assert names, f"panel {panel['title']!r} queries no metric"
        unknown = names - exported
        assert not unknown, f"panel {panel['title']!r} queries metrics raykv does not export: {sorted(unknown)}"
        used |= names
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        assert _names(text) <= exported, f"variable {var['name']!r} queries unknown metrics"
    # And the dashboard shows every metric raykv defines.
    shown = {spec.name for spec in metrics.SPECS.values() if set(spec.exported_names()) & used}
    assert shown == set(metrics.SPECS), f"metrics without a panel: {sorted(set(metrics.SPECS) - shown)}"


def test_no_ray_metric_is_created_outside_the_catalog() -> None:
    """All raykv metrics go through ``raykv.metrics.catalog.metric`` (so the catalog is complete)."""
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in [*root.joinpath("raykv").rglob("*.py"), *root.joinpath("tiers").rglob("*.py")]:
        if path.name == "catalog.py" and path.parent.name == "metrics":
            continue
        text = path.read_text()
        if re.search(r"\b(metrics\.)?(Counter|Gauge|Histogram)\(\s*f?[\"']raykv_", text):
            offenders.append(str(path.relative_to(root)))
    assert not offenders, offenders
