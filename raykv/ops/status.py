"""The cluster's cache at a glance: services, tiers per node, occupancy, hit rates, directory size.

``collect_status`` gathers one JSON-able picture (actor calls for the
services and tier actors, plus the engines' lookup counters scraped from
each node's metrics port); ``format_status`` prints it as tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypedDict, cast

import ray
from ray.actor import ActorHandle

from raykv.core import naming
from raykv.core.identity import KVIdentity
from raykv.core.named import find_actor
from raykv.core.outcomes import NoAnswer, answers_within
from raykv.core.units import fmt_bytes
from raykv.core.wire import PENDING, HolderInfo, JsonValue, Report
from raykv.directory.messages import AgentStats, ShardStats
from raykv.holders.messages import HolderStats
from raykv.services.cluster import RaykvServices, identity_report


class HitRate(TypedDict):
    """Engine-side lookups of a tier (or of a tier on one node)."""

    lookups: int
    hits: int
    hit_rate: float | None


class ServiceRow(TypedDict, total=False):
    name: str
    kind: str
    alive: bool
    keys: int
    holders: int
    rules_version: int
    error: str


class TierRow(TypedDict, total=False):
    """One holder actor: its ``HolderInfo`` fields, then what it reports."""

    holder_id: str
    tier_type: str
    medium: str
    actor_name: str
    namespace: str
    node_id: str | None
    owner: str | None
    alive: bool
    error: str
    blocks: JsonValue
    bytes_used: JsonValue
    capacity_bytes: JsonValue
    occupancy: float | None
    #: ``HolderStats.report()``.
    stats: Report
    tenant_bytes: dict[str, int]
    tenant_quotas: dict[str, int]
    #: Pinned bytes per tenant and the soonest expiries (``raykv.core.pins``).
    tenant_pinned_bytes: dict[str, int]
    pin_expiries: list[JsonValue]
    engine_lookups: HitRate


class IdentityRow(TypedDict):
    tag: str
    model: str | None
    revision: str | None
    label: str
    layout: Report
    blocks: int
    blocks_by_tier: dict[str, int]


class DirectoryRow(TypedDict):
    shards: int
    keys: int
    keys_per_shard: list[int]


class AgentRow(TypedDict, total=False):
    """A node's directory agent (``raykv.directory.agent``)."""

    node_id: str
    alive: bool
    window_ms: float
    view_keys: int
    local_keys: int
    view_bytes: int
    #: "all" (complete: every key of the directory), "filling" or "asked" (own and asked keys).
    view: str
    #: Whether engines read the view in /dev/shm (False: no room there; they ask the agent).
    view_shared: bool
    engine_calls: int
    shard_calls: int
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    resets: int
    error: str


class NodeRow(TypedDict):
    node_id: str
    address: str | None
    alive: bool
    object_store_bytes: int


class ClusterStatus(TypedDict):
    """``collect_status``'s picture (``raykv status --json`` prints it as is)."""

    namespace: str
    ray_address: str
    services: list[ServiceRow]
    directory: DirectoryRow
    agents: list[AgentRow]
    rules_version: int
    tiers: list[TierRow]
    #: Each engine's pending entries: blocks it is computing now (``raykv.holders.pending``).
    pending: list[TierRow]
    identities: list[IdentityRow]
    hit_rates: dict[str, HitRate]
    nodes: list[NodeRow]


def _number(value: JsonValue) -> int | float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _counts(value: JsonValue) -> dict[str, int]:
    """A report's ``{name: int}`` figure (tenant bytes, quotas); {} when absent."""
    if not isinstance(value, dict):
        return {}
    return {k: int(v) for k, v in value.items() if isinstance(v, (int, float))}


def _occupancy(figures: Report) -> TierRow:
    """Blocks, bytes used and capacity of a tier actor, whatever its kind."""
    blocks = figures.get("blocks", figures.get("files"))
    used = figures.get("bytes_used", figures.get("bytes"))
    cap = figures.get("capacity_bytes")
    used_n, cap_n = _number(used), _number(cap)
    return {
        "blocks": blocks,
        "bytes_used": used,
        "capacity_bytes": cap,
        "occupancy": (used_n / cap_n) if used_n is not None and cap_n else None,
    }


def engine_hit_rates(series: list[tuple[str, dict[str, str], float]]) -> dict[str, HitRate]:
    """Engine-side lookups per tier and per (tier, node), from scraped ``ray_raykv_*`` series."""
    out: dict[str, HitRate] = {}
    for name, labels, value in series:
        field = {"ray_raykv_lookups_total": "lookups", "ray_raykv_lookup_hits_total": "hits"}.get(name)
        if field is None:
            continue
        tier, node = labels.get("tier", "?"), labels.get("node", "?")
        for key in (tier, f"{tier}@{node}"):
            entry = out.setdefault(key, {"lookups": 0, "hits": 0, "hit_rate": None})
            if field == "lookups":
                entry["lookups"] += int(value)
            else:
                entry["hits"] += int(value)
    for entry in out.values():
        entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else None
    return out


def _why(e: object) -> str:
    """How a status row names an actor that did not answer."""
    return str(e) if isinstance(e, NoAnswer) else type(e).__name__


def _tier_row(info: HolderInfo, answer: object) -> TierRow:
    """A holder's row, from its ``stats()`` answer (or what it raised)."""
    row = cast(TierRow, dataclasses.asdict(info))
    if not isinstance(answer, HolderStats):  # dead, hung or unreachable holder
        row.update(
            {
                "alive": False,
                "error": _why(answer),
                "blocks": None,
                "bytes_used": None,
                "capacity_bytes": None,
                "occupancy": None,
            }
        )
        return row
    stats = answer
    row["alive"] = True
    row.update(_occupancy(stats.figures))
    row["stats"] = stats.report()
    row["tenant_bytes"] = _counts(stats.figures.get("tenant_bytes"))
    row["tenant_quotas"] = _counts(stats.figures.get("tenant_quotas"))
    row["tenant_pinned_bytes"] = _counts(stats.figures.get("tenant_pinned_bytes"))
    expiries = stats.figures.get("pin_expiries")
    row["pin_expiries"] = list(expiries) if isinstance(expiries, list) else []
    return row


def _shard_stats(answers: list[object]) -> list[ServiceRow]:
    """One row per directory shard, from its ``stats()`` answer (a dead shard restarts and
    rebuilds; reported meanwhile)."""
    rows: list[ServiceRow] = []
    for i, s in enumerate(answers):
        if not isinstance(s, ShardStats):
            name = naming.directory_shard(i)
            rows.append(
                {"name": name, "kind": "directory_shard", "alive": False, "keys": 0, "holders": 0, "error": _why(s)}
            )
            continue
        rows.append(
            {
                "name": naming.directory_shard(s.shard),
                "kind": "directory_shard",
                "alive": True,
                "keys": s.keys,
                "holders": len(s.holders),
            }
        )
    return rows


def _agent_rows(answers: dict[str, object]) -> list[AgentRow]:
    """One row per node's directory agent, from its ``stats()`` answer."""
    rows: list[AgentRow] = []
    for node_id, a in sorted(answers.items()):
        if not isinstance(a, AgentStats):
            rows.append({"node_id": node_id, "alive": False, "error": _why(a)})
            continue
        rows.append(
            {
                "node_id": node_id,
                "alive": True,
                "window_ms": a.window_ms,
                "view_keys": a.view_keys,
                "local_keys": a.local_keys,
                "view_bytes": a.view_bytes,
                "view": a.view_scope,
                "view_shared": a.view_shared,
                "engine_calls": a.lookups,
                "shard_calls": a.shard_calls.get("apply", 0),
                "lag_p50_ms": None if a.lag_p50_s is None else round(a.lag_p50_s * 1e3, 2),
                "lag_p99_ms": None if a.lag_p99_s is None else round(a.lag_p99_s * 1e3, 2),
                "resets": a.resets,
            }
        )
    return rows


def collect_status(services: RaykvServices, timeout: float = 10.0, metrics: bool = True) -> ClusterStatus:
    """One JSON-able picture of a namespace's raykv services and tiers."""
    ns = services.namespace
    control = services.control_stats(timeout)
    holders = sorted(services.holders(timeout), key=lambda h: (h.tier_type, str(h.node_id)))
    agents = sorted(services.directory_agents().items())
    # Every actor at once, under one deadline (a holder gone since the control actor listed it: no call).
    actors: list[ActorHandle | None] = [*services.directory.shards, *(agent for _, agent in agents)]
    actors += [find_actor(info.actor_name, ns) for info in holders]
    got = answers_within({i: a.stats.remote() for i, a in enumerate(actors) if a is not None}, timeout)
    answers = [got.get(i, ValueError("no such actor")) for i in range(len(actors))]
    n_shards, n_agents = len(services.directory.shards), len(agents)
    shards = _shard_stats(answers[:n_shards])
    agent_answers = {node_id: a for (node_id, _), a in zip(agents, answers[n_shards : n_shards + n_agents])}
    holder_answers = answers[n_shards + n_agents :]
    series: list[tuple[str, dict[str, str], float]] = []
    if metrics:
        from raykv.metrics.scrape import scrape_cluster

        # (the whole timeout: a busy node's metrics agent can take seconds to answer)
        series = scrape_cluster(timeout=timeout)
    rates = engine_hit_rates(series)

    tiers: list[TierRow] = []
    pending: list[TierRow] = []
    held: list[tuple[str, HolderStats]] = []
    for info, answer in zip(holders, holder_answers):
        row = _tier_row(info, answer)
        stats = answer if isinstance(answer, HolderStats) else None
        if info.medium == PENDING:  # no tier: blocks being computed, not held
            pending.append(row)
            continue
        key = f"{info.tier_type}@{info.node_id}" if info.node_id else info.tier_type
        row["engine_lookups"] = rates.get(key, {"lookups": 0, "hits": 0, "hit_rate": None})
        tiers.append(row)
        if stats is not None:
            held.append((info.tier_type, stats))
    identities = identity_rows(services.identities(timeout), held)

    control_row: ServiceRow = {
        "name": naming.CONTROL_ACTOR,
        "kind": "control",
        "alive": True,
        "holders": control.holders,
        "rules_version": control.rules_version,
    }
    keys = [s.get("keys", 0) for s in shards]
    return {
        "namespace": ns,
        "ray_address": ray.get_runtime_context().gcs_address,
        "services": [control_row, *shards],
        "directory": {"shards": len(shards), "keys": sum(keys), "keys_per_shard": keys},
        "agents": _agent_rows(agent_answers),
        "rules_version": control.rules_version,
        "tiers": tiers,
        "pending": pending,
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


def identity_rows(known: Mapping[str, KVIdentity], held: list[tuple[str, HolderStats]]) -> list[IdentityRow]:
    """One row per KV identity (announced by an engine, or holding blocks):
    its fields and its blocks per tier and in all. ``held``: (tier type, stats) of each holder."""
    per_tag: dict[str, dict[str, int]] = {}
    for tier_type, stats in held:
        for tag, n in stats.blocks_by_identity.items():
            where = per_tag.setdefault(tag, {})
            where[tier_type] = where.get(tier_type, 0) + n
    rows: list[IdentityRow] = []
    for tag in sorted(set(known) | set(per_tag)):
        ident = known.get(tag)
        by_tier = per_tag.get(tag, {})
        fields = identity_report(ident) if ident is not None else {}
        rows.append(
            {
                "tag": tag,
                "model": ident.model if ident is not None else None,
                "revision": ident.revision if ident is not None else None,
                "label": ident.label() if ident is not None else "(unknown: announced before a control restart)",
                "layout": _report(fields.get("layout")),
                "blocks": sum(by_tier.values()),
                "blocks_by_tier": by_tier,
            }
        )
    return rows


def _report(value: JsonValue) -> Report:
    return value if isinstance(value, dict) else {}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _where(t: TierRow) -> str:
    """A holder's node, else its root (fs), else "shared"."""
    return str(t.get("node_id") or t.get("stats", {}).get("root") or "shared")


def _tenant_lines(tiers: list[TierRow]) -> list[str]:
    """Bytes per tenant (and quota) of each tier actor, when tenants or quotas exist."""
    from raykv.core.tenants import DEFAULT_TENANT, EVERY_TENANT

    rows = []
    for t in tiers:
        held, quotas = t.get("tenant_bytes") or {}, t.get("tenant_quotas") or {}
        if set(held) <= {DEFAULT_TENANT} and not quotas:
            continue
        where = _where(t)
        parts = []
        for tenant in sorted(set(held) | (set(quotas) - {EVERY_TENANT})):
            quota = quotas.get(tenant, quotas.get(EVERY_TENANT))
            parts.append(
                f"{tenant or '(none)'} {fmt_bytes(held.get(tenant, 0))}"
                + (f" / {fmt_bytes(quota)}" if quota is not None else "")
            )
        rows.append(f"  {t['tier_type']:<13} {where[:30]:<30} " + ", ".join(parts))
    return ["", "bytes per tenant (/ quota):", *rows] if rows else []


def _pin_lines(tiers: list[TierRow]) -> list[str]:
    """Pinned bytes per tenant and the soonest expiry of each tier actor that holds pins."""
    rows = []
    for t in tiers:
        pinned = t.get("tenant_pinned_bytes") or {}
        if not pinned:
            continue
        parts = ", ".join(f"{tenant or '(none)'} {fmt_bytes(b)}" for tenant, b in sorted(pinned.items()))
        soonest = [_report(e) for e in t.get("pin_expiries") or []]
        first = (
            f"; soonest expiry {_number(soonest[0].get('seconds_left')) or 0:.0f} s "
            f"({soonest[0].get('blocks')} blocks of {soonest[0].get('tenant') or '(none)'})"
            if soonest
            else ""
        )
        rows.append(f"  {t['tier_type']:<13} {_where(t)[:30]:<30} {parts}{first}")
    return ["", "pinned bytes per tenant (cache_ttl_s):", *rows] if rows else []


def _agent_lines(agents: list[AgentRow]) -> list[str]:
    """The directory agents' table: window, view size, lag, calls saved."""
    if not agents:
        return []
    lines = [
        "",
        f"{'directory agent (node)':<22} {'alive':<6} {'window':>7} {'view':>7} {'view keys':>10} {'local':>8} "
        f"{'view mem':>9} {'engine calls':>12} {'shard calls':>11} {'lag p50/p99 ms':>15} {'resets':>6}",
    ]
    for a in agents:
        if not a.get("alive"):
            lines.append(f"{a['node_id'][:22]:<22} {'NO':<6} {a.get('error', '')}")
            continue
        p50, p99 = a.get("lag_p50_ms"), a.get("lag_p99_ms")
        lag = "-" if p50 is None or p99 is None else f"{p50:.1f}/{p99:.1f}"
        lines.append(
            f"{a['node_id'][:22]:<22} {'yes':<6} {a.get('window_ms', 0):>5.1f}ms {a.get('view', '-'):>7} "
            f"{a.get('view_keys', 0):>10} "
            f"{a.get('local_keys', 0):>8} {fmt_bytes(a.get('view_bytes', 0)):>9} {a.get('engine_calls', 0):>12} "
            f"{a.get('shard_calls', 0):>11} {lag:>15} {a.get('resets', 0):>6}"
        )
    unshared = [a["node_id"][:12] for a in agents if a.get("alive") and not a.get("view_shared", True)]
    if unshared:
        lines.append(
            f"  view not in /dev/shm (no room) on node(s) {', '.join(unshared)}: their engines ask the agent "
            "for every lookup; give /dev/shm more room (--shm-size) or lower agent_view_keys"
        )
    return lines


def format_status(status: ClusterStatus) -> str:
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
            + (f"  {s['error']}" if s.get("error") else "")
        )
    lines += _agent_lines(status.get("agents", []))
    lines += [
        "",
        f"{'tier':<13} {'node / root':<30} {'alive':<6} {'blocks':>8} {'used':>10} {'capacity':>10} "
        f"{'occupancy':>9} {'hit rate':>9} {'lookups':>8}",
    ]
    engines = [t for t in status["tiers"] if t["tier_type"] == "engine"]
    for t in status["tiers"]:
        if t["tier_type"] == "engine":
            continue
        rate = t.get("engine_lookups")
        hit_rate, lookups = (rate["hit_rate"], rate["lookups"]) if rate is not None else (None, 0)
        cap = _number(t.get("capacity_bytes"))
        lines.append(
            f"{t['tier_type']:<13} {_where(t)[:30]:<30} {'yes' if t['alive'] else 'NO':<6} "
            f"{t.get('blocks') if t.get('blocks') is not None else '-'!s:>8} "
            f"{fmt_bytes(_number(t.get('bytes_used'))):>10} "
            f"{fmt_bytes(cap) if cap else 'unlimited':>10} "
            f"{_pct(t.get('occupancy')):>9} {_pct(hit_rate):>9} {lookups:>8}"
            + (f"  {t['error']}" if t.get("error") else "")
        )
    lines += _tenant_lines(status["tiers"])
    lines += _pin_lines(status["tiers"])
    if engines:
        lines += ["", f"{'engine (replica actor)':<34} {'node':<14} {'alive':<6} {'cached':>8}  loaded from raykv"]
        for t in engines:
            loaded = _counts(t.get("stats", {}).get("loaded_by_tier"))
            by_tier = ", ".join(f"{k} {v}" for k, v in sorted(loaded.items())) or "-"
            lines.append(
                f"{str(t.get('owner') or t['holder_id'])[:34]:<34} {str(t.get('node_id'))[:14]:<14} "
                f"{'yes' if t['alive'] else 'NO':<6} {t.get('blocks') if t.get('blocks') is not None else '-'!s:>8}  "
                f"{by_tier}"
            )
    if status.get("pending"):
        lines += ["", f"{'being computed (replica actor)':<34} {'node':<14} {'alive':<6} {'blocks':>8}"]
        for t in status["pending"]:
            lines.append(
                f"{str(t.get('owner') or t['holder_id'])[:34]:<34} {str(t.get('node_id'))[:14]:<14} "
                f"{'yes' if t['alive'] else 'NO':<6} {t.get('blocks') if t.get('blocks') is not None else '-'!s:>8}"
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
