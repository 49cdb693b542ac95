"""raykv's own options (``RaykvConfig``), validated whole: fields, each tier and rule, and how they fit."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from raykv.core.factory import tier_instance_key, validate_tier_config
from raykv.core.fields import check_namespace, opt, parse_options
from raykv.core.tenants import check_shared_tenants
from raykv.core.validate import ConfigError
from raykv.core.wire import Report
from raykv.policy.rules import PolicyRule, check_rule_tier


@dataclass
class RaykvConfig:
    """Cluster-wide raykv settings (what `raykv start` and `raykv.attach` use)."""

    namespace: str = opt("raykv", kind=str, check=check_namespace, doc="Ray namespace of the raykv actors")
    directory_shards: int = opt(2, kind=int, min=1, max=1024, warn_above=64, doc="number of directory shard actors")
    policy_refresh_s: float = opt(
        5.0, kind=float, min=0.05, max=3600.0, doc="long-poll period of engine-side policy caches"
    )
    lookup_ttl_s: float = opt(
        2.0, kind=float, min=0.0, max=3600.0, warn_above=60.0, doc="how long an engine trusts a directory answer"
    )
    # DESIGN.md's rule is that the scheduler thread never waits on I/O; this is
    # the one bounded exception, at a request's first lookup. `raykv bench e2e`
    # (README) measured it: one fewer engine step per promoted request.
    lookup_wait_ms: float = opt(
        5.0,
        kind=float,
        min=0.0,
        max=1000.0,
        doc="at a request's first lookup, how long the engine waits for the one directory call that resolves "
        "the request's whole prefix (answered in time: HIT/MISS in that step; else RETRY, answered next step). "
        "It waits only while its recent directory round trips fit in this (one probe a second otherwise); "
        "0: never wait (the prefix still goes in one call)",
    )
    # A RETRY holds a request back one engine step; one is normal (its keys are
    # asked at the end of the step, answered in a round trip of ~1 ms). 50 ms is
    # tens of round trips even on a loaded host and a few decode steps; past it the
    # directory is not answering in time, and prefilling a 1k-token prefix costs
    # about that (130 ms here for the 20M realistic-ratio model, tens of ms on a
    # GPU for 8B), so waiting longer costs the request more than computing.
    lookup_retry_budget_ms: float = opt(
        50.0,
        kind=float,
        min=0.0,
        max=60_000.0,
        doc="how long a request may be held back by RETRY answers (its directory answer not back yet) in a run "
        "of consecutive lookup rounds; past it, its still-unknown keys answer MISS and it computes them "
        "(counted in raykv_lookup_retry_budget_misses); 0: never RETRY",
    )
    lookup_cache_entries: int = opt(
        131_072,
        kind=int,
        min=1,
        doc="most directory answers (and most queued and in-flight lookups) one engine process keeps; "
        "least recently used go first",
    )
    directory_agent: bool = opt(
        True,
        kind=bool,
        doc="run a directory agent on each engine's node: engines read the node's view of the directory from "
        "shared memory (no Ray call for keys it knows) and the agent merges the rest into one call per shard "
        "per window; false: every engine calls the shards itself",
    )
    agent_window_ms: float = opt(
        2.0,
        kind=float,
        min=0.0,
        max=100.0,
        doc="how long a node's directory agent collects its engines' lookups before one call per shard "
        "(under one engine step; long enough that engines stepping together share a call)",
    )
    agent_view_keys: int = opt(
        1_000_000,
        kind=int,
        min=1024,
        doc="most keys a node's directory view keeps (12-24 bytes each in /dev/shm); past it, answers for "
        "other nodes' keys are dropped first, this node's own holders' keys stay",
    )
    agent_view_all_keys: bool = opt(
        True,
        kind=bool,
        doc="each node's view follows every key of the directory while it fits in agent_view_keys: a key it "
        "does not list is then held by nobody, so lookups never need a call; past agent_view_keys (or with "
        "false) it keeps only its own holders' keys and the ones its engines asked for",
    )
    pending_entries: bool = opt(
        False,
        kind=bool,
        doc="compute once: an engine computing blocks nobody holds lists them in the directory as pending, "
        "and another engine whose request meets them may wait for them to register and load them instead "
        "of computing them too (its rule: raykv.engine.pending); needs directory_agent; off by default "
        "until its benchmark is in",
    )
    pending_max_wait_ms: float = opt(
        30_000.0,
        kind=float,
        min=0.0,
        max=600_000.0,
        doc="longest a pending entry is listed, and so the longest a request waits for another engine's "
        "blocks (a shorter wait when both engines' compute times are measured: an entry lives 2x its "
        "announcer's estimate, and an engine that dies ends its entries at once); long enough for a long "
        "prefix's prefill under load (a shorter cap recomputes it); 0: never wait",
    )
    holder_reconcile_s: float = opt(
        5.0,
        kind=float,
        min=0.0,
        max=3600.0,
        doc="seconds between a tier actor's check that each directory shard lists exactly its keys "
        "(one count per shard; a shard that differs twice in a row gets the full listing); 0 = off",
    )
    status_log_s: float = opt(
        30.0,
        kind=float,
        min=0.0,
        doc="seconds between the one-line live status each raykv actor logs (the Ray dashboard shows it "
        "under the actor's Logs; logged only when it changed); 0 = off",
    )
    tiers: list = opt([], kind=list, doc="tier configs ({'type': ..., ...}) started with `raykv start`")
    rules: list = opt([], kind=list, doc="policy rules registered at start")
    shared_tenants: dict = opt(
        {},
        kind=dict,
        doc="tenants that share KV blocks (opt-in; by default every tenant named by kv_transfer_params['tenant'] "
        "sees only its own blocks): {'team-x': ['tenant-a', 'tenant-b']} shares within each group, "
        "{'public': ['*']} makes every tenant not in another group share with all. Shared prompt caches leak "
        "prompts through timing (CVE-2025-46570): share only between tenants that trust each other",
    )

    @classmethod
    def from_dict(cls, raw: Mapping[str, object] | None) -> RaykvConfig:
        """Validate ``raw`` (fields, each tier and rule, and how they fit together)."""
        cfg = parse_options(cls, raw, "")
        seen: dict[tuple[str, object], int] = {}
        for i, tier in enumerate(cfg.tiers):
            where = f"tiers[{i}]"
            validate_tier_config(tier, where)
            ns = tier.get("namespace")
            if ns is not None and ns != cfg.namespace:
                raise ConfigError(
                    f"{where}.namespace",
                    f"{ns!r} differs from the config's namespace {cfg.namespace!r}; "
                    "leave it out (tiers use the config's namespace)",
                )
            key = tier_instance_key(tier, where)
            if key in seen:
                raise ConfigError(
                    where,
                    f"duplicate of tiers[{seen[key]}] (same {key[0]} tier"
                    + (f" {key[1]!r}" if key[1] else "")
                    + "); list each tier once",
                )
            seen[key] = i
        check_shared_tenants(cfg.shared_tenants)
        types = [t["type"] for t in cfg.tiers]
        names: dict[str, int] = {}
        for i, raw_rule in enumerate(cfg.rules):
            rule = PolicyRule.from_dict(raw_rule, f"rules[{i}]")
            check_rule_tier(rule.tier, f"rules[{i}].tier", types or None)
            if rule.name:
                if rule.name in names:
                    raise ConfigError(
                        f"rules[{i}].name", f"{rule.name!r} is already the name of rules[{names[rule.name]}]"
                    )
                names[rule.name] = i
        return cfg

    def to_dict(self) -> Report:
        """Every field, as JSON (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)
