"""The cluster's cache at a glance: services, tiers per node, occupancy, hit rates, directory size.

``collect_status`` gathers one JSON-able picture (actor calls for the
services and tier actors, plus the engines' lookup counters scraped from
each node's metrics port); ``format_status`` prints it as tables.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from raykv.core import naming
from raykv.core.errors import RaykvError
from raykv.core.identity import KVIdentity
from raykv.core.units import fmt_bytes
from raykv.services.cluster import RaykvServices


def check_reachable(address: str | None, timeout: float = 3.0) -> None:
    """Fail fast (RaykvError) when an explicit ``host:port`` Ray address does not answer.

    ``ray.init`` keeps retrying an unreachable GCS for a minute or more; a
    TCP connect tells the user at once. ``auto`` / ``ray://`` addresses are
    left to Ray (it already fails fast when no local cluster runs).
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise RaykvError(
            f"no Ray cluster reachable at address={address!r} ({e.strerror or e}): start one with "
            "`ray start --head` (or `ray up`), or pass the cluster's address"
        ) from e


def _occupancy(stats: dict[str, Any]) -> dict[str, Any]:
    """Blocks, bytes used and capacity of a tier actor, whatever its kind."""
    blocks = stats.get("blocks", stats.get("files"))
    used = stats.get("bytes_used", stats.get("bytes"))
    cap = stats.get("capacity_bytes")
    return {
        "blocks": blocks,
        "bytes_used": used,
        "capacity_bytes": cap,
        "occupancy": (used / cap) if used is not None and cap else None,
    }


def engine_hit_rates(series: list[tuple[str, dict[str, str], float]]) -> dict[str, dict[str, Any]]:
    """Engine-side lookups per tier and per (tier, node), from scraped ``ray_raykv_*`` series."""
    out: dict[str, dict[str, Any]] = {}
    for name, labels, value in series:
        field = {"ray_raykv_lookups_total": "lookups", "ray_raykv_lookup_hits_total": "hits"}.get(name)
        if field is None:
            continue
        tier, node = labels.get("tier", "?"), labels.get("node", "?")
        for key in (tier, f"{tier}@{node}"):
            entry = out.setdefault(key, {"lookups": 0, "hits": 0})
            entry[field] += int(value)
    for entry in out.values():
        entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else None
    return out


def collect_status(services: RaykvServices, timeout: float = 10.0, metrics: bool = True) -> dict[str, Any]:
    """One JSON-able picture of a namespace's raykv services and tiers."""
    ns = services.namespace
    shards = []
    for i, shard in enumerate(services.directory.shards):
        try:
            shards.append({**ray.get(shard.stats.remote(), timeout=timeout), "alive": True})
        except Exception as e:  # a dead shard restarts and rebuilds; report it meanwhile
            shards.append({"shard": i, "keys": 0, "holders": {}, "alive": False, "error": type(e).__name__})
    control = services.read_control("stats", timeout)
    series: list[tuple[str, dict[str, str], float]] = []
    if metrics:
        from raykv.metrics.scrape import scrape_cluster

        series = scrape_cluster(timeout=min(timeout, 3.0))
    rates = engine_hit_rates(series)

    tiers = []
    for info in services.holders():
        entry: dict[str, Any] = dict(info)
        try:
            actor = ray.get_actor(info["actor_name"], namespace=ns)
            stats = ray.get(actor.stats.remote(), timeout=timeout)
            entry.update(alive=True, **_occupancy(stats), stats=stats)
            entry["tenant_bytes"] = stats.get("tenant_bytes", {})
            entry["tenant_quotas"] = stats.get("tenant_quotas", {})
        except Exception as e:  # dead or unreachable holder
            entry.update(
                alive=False, error=type(e).__name__, blocks=None, bytes_used=None, capacity_bytes=None, occupancy=None
            )
        key = f"{info['tier_type']}@{info['node_id']}" if info.get("node_id") else info["tier_type"]
        entry["engine_lookups"] = rates.get(key, {"lookups": 0, "hits": 0, "hit_rate": None})
        tiers.append(entry)
    tiers.sort(key=lambda t: (t["tier_type"], str(t.get("node_id"))))
    identities = identity_rows(services.read_control("identities", timeout), tiers)

    service_rows = [
        {
            "name": naming.CONTROL_ACTOR,
            "kind": "control",
            "alive": True,
            "holders": control.get("holders"),
            "rules_version": control["rules_version"],
        }
    ]
    service_rows += [
        {
            "name": naming.directory_shard(s["shard"]),
            "kind": "directory_shard",
            "alive": s["alive"],
            "keys": s["keys"],
            "holders": len(s.get("holders", {})),
            **({"error": s["error"]} if "error" in s else {}),
        }
        for s in shards
    ]
    return {
        "namespace": ns,
        "ray_address": ray.get_runtime_context().gcs_address,
        "services": service_rows,
        "directory": {
            "shards": len(shards),
            "keys": sum(s["keys"] for s in shards),
            "keys_per_shard": [s["keys"] for s in shards],
        },
        "rules_version": control["rules_version"],
        "tiers": tiers,
        "identities": identities,
        "hit_rates": {k: v for k, v in rates.items() if "@" not in k},
        "nodes": [
            {
                "node_id": n["NodeID"],
                "address": n.get("NodeManagerAddress"),
                "alive": bool(n.get("Alive")),
                "object_store_bytes": int(n.get("Resources", {}).get("object_store_memory", 0)),
            }
            for n in ray.nodes()
        ],
    }


def identity_rows(known: dict[str, dict[str, Any]], tiers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per KV identity (announced by an engine, or holding blocks):
    its fields and its blocks per tier and in all."""
    per_tag: dict[str, dict[str, int]] = {}
    for t in tiers:
        for tag, n in (t.get("stats") or {}).get("blocks_by_identity", {}).items():
            where = per_tag.setdefault(tag, {})
            where[t["tier_type"]] = where.get(t["tier_type"], 0) + n
    rows = []
    for tag in sorted(set(known) | set(per_tag)):
        ident = known.get(tag, {})
        by_tier = per_tag.get(tag, {})
        label = KVIdentity.from_dict(ident).label() if ident else "(unknown: announced before a control restart)"
        rows.append(
            {
                "tag": tag,
                "model": ident.get("model"),
                "revision": ident.get("revision"),
                "label": label,
                "layout": ident.get("layout", {}),
                "blocks": sum(by_tier.values()),
                "blocks_by_tier": by_tier,
            }
        )
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _tenant_lines(tiers: list[dict[str, Any]]) -> list[str]:
    """Bytes per tenant (and quota) of each tier actor, when tenants or quotas exist."""
    from raykv.core.tenants import DEFAULT_TENANT, EVERY_TENANT

    rows = []
    for t in tiers:
        held, quotas = t.get("tenant_bytes") or {}, t.get("tenant_quotas") or {}
        if set(held) <= {DEFAULT_TENANT} and not quotas:
            continue
        where = t.get("node_id") or t.get("stats", {}).get("root") or "shared"
        parts = []
        for tenant in sorted(set(held) | (set(quotas) - {EVERY_TENANT})):
            quota = quotas.get(tenant, quotas.get(EVERY_TENANT))
            parts.append(
                f"{tenant or '(none)'} {fmt_bytes(held.get(tenant, 0))}"
                + (f" / {fmt_bytes(quota)}" if quota is not None else "")
            )
        rows.append(f"  {t['tier_type']:<13} {str(where)[:30]:<30} " + ", ".join(parts))
    return ["", "bytes per tenant (/ quota):", *rows] if rows else []


def format_status(status: dict[str, Any]) -> str:
    """Terminal tables of ``collect_status``'s result."""
    d = status["directory"]
    alive_nodes = sum(1 for n in status.get("nodes", []) if n["alive"])
    lines = [
        f"raykv in Ray namespace {status['namespace']!r} (cluster {status.get('ray_address')}, "
        f"{alive_nodes} node(s) alive)",
        f"directory: {d['shards']} shard(s), {d['keys']} keys {d['keys_per_shard']}; "
        f"policy rules v{status['rules_version']}",
        "",
        f"{'service':<22} {'alive':<6} {'keys':>8} {'holders':>8}",
    ]
    for s in status["services"]:
        lines.append(
            f"{s['name']:<22} {'yes' if s['alive'] else 'NO':<6} {s.get('keys', '-')!s:>8} {s.get('holders', '-')!s:>8}"
        )
    lines += [
        "",
        f"{'tier':<13} {'node / root':<30} {'alive':<6} {'blocks':>8} {'used':>10} {'capacity':>10} "
        f"{'occupancy':>9} {'hit rate':>9} {'lookups':>8}",
    ]
    engines = [t for t in status["tiers"] if t["tier_type"] == "engine"]
    for t in status["tiers"]:
        if t["tier_type"] == "engine":
            continue
        where = t.get("node_id") or t.get("stats", {}).get("root") or "shared"
        rate = t.get("engine_lookups", {})
        lines.append(
            f"{t['tier_type']:<13} {str(where)[:30]:<30} {'yes' if t['alive'] else 'NO':<6} "
            f"{t.get('blocks') if t.get('blocks') is not None else '-'!s:>8} {fmt_bytes(t.get('bytes_used')):>10} "
            f"{fmt_bytes(t.get('capacity_bytes')) if t.get('capacity_bytes') else 'unlimited':>10} "
            f"{_pct(t.get('occupancy')):>9} {_pct(rate.get('hit_rate')):>9} {rate.get('lookups', 0):>8}"
        )
    lines += _tenant_lines(status["tiers"])
    if engines:
        lines += ["", f"{'engine (replica actor)':<34} {'node':<14} {'alive':<6} {'cached':>8}  loaded from raykv"]
        for t in engines:
            loaded = (t.get("stats") or {}).get("loaded_by_tier") or {}
            by_tier = ", ".join(f"{k} {v}" for k, v in sorted(loaded.items())) or "-"
            lines.append(
                f"{str(t.get('owner') or t['holder_id'])[:34]:<34} {str(t.get('node_id'))[:14]:<14} "
                f"{'yes' if t['alive'] else 'NO':<6} {t.get('blocks') if t.get('blocks') is not None else '-'!s:>8}  "
                f"{by_tier}"
            )
    if not status["tiers"]:
        lines.append("(no tier actors yet: they start with `raykv start --config` or the first engine)")
    if status.get("identities"):
        lines += ["", f"{'KV identity':<16} {'blocks':>8}  model"]
        for i in status["identities"]:
            tiers = ", ".join(f"{k} {v}" for k, v in sorted(i["blocks_by_tier"].items()))
            lines.append(f"{i['tag']:<16} {i['blocks']:>8}  {i['label']}" + (f"  ({tiers})" if tiers else ""))
    if status.get("hit_rates"):
        lines += [
            "",
            "engine lookups per tier (all nodes): "
            + ", ".join(
                f"{tier} {_pct(r['hit_rate'])} of {r['lookups']}" for tier, r in sorted(status["hit_rates"].items())
            ),
        ]
    return "\n".join(lines)
