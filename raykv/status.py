"""The cluster's cache at a glance: services, tiers per node, occupancy, hit rates."""

from __future__ import annotations

from typing import Any

import ray

from raykv.cluster import RaykvServices


def collect_status(services: RaykvServices, timeout: float = 10.0) -> dict[str, Any]:
    """One JSON-able picture of a namespace's raykv services."""
    shards = services.directory.stats(timeout=timeout)
    holders = services.holders()
    tiers = []
    for info in holders:
        entry: dict[str, Any] = dict(info)
        try:
            actor = ray.get_actor(info["actor_name"], namespace=services.namespace)
            entry["stats"] = ray.get(actor.stats.remote(), timeout=timeout)
            entry["alive"] = True
        except Exception as e:  # dead or unreachable holder
            entry["alive"] = False
            entry["error"] = type(e).__name__
        tiers.append(entry)
    control = ray.get(services.control.stats.remote(), timeout=timeout)
    return {
        "namespace": services.namespace,
        "directory": {
            "shards": len(shards),
            "keys": sum(s["keys"] for s in shards),
            "keys_per_shard": [s["keys"] for s in shards],
        },
        "rules_version": control["rules_version"],
        "tiers": tiers,
    }


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(status: dict[str, Any]) -> str:
    """A terminal table of ``collect_status``'s result."""
    d = status["directory"]
    lines = [
        f"raykv namespace {status['namespace']!r}: directory {d['shards']} shard(s), "
        f"{d['keys']} keys {d['keys_per_shard']}, policy rules v{status['rules_version']}",
        "",
        f"{'tier':<13} {'where':<28} {'alive':<6} {'blocks':>8} {'used':>11} {'capacity':>11} {'hit rate':>9}",
    ]
    for t in status["tiers"]:
        s = t.get("stats", {})
        where = t.get("node_id") or s.get("root") or "shared"
        hits, lookups = s.get("hits"), s.get("loads_requested") or s.get("lookups")
        rate = f"{hits / lookups:.0%}" if hits is not None and lookups else "-"
        lines.append(
            f"{t['tier_type']:<13} {str(where)[:28]:<28} {'yes' if t['alive'] else 'NO':<6} "
            f"{s.get('blocks', '-'):>8} {_fmt_bytes(s.get('bytes_used')):>11} "
            f"{_fmt_bytes(s.get('capacity_bytes')):>11} {rate:>9}"
        )
    if not status["tiers"]:
        lines.append("(no tier actors yet: they start with `raykv start --config` or the first engine)")
    return "\n".join(lines)
