"""Start or attach to raykv's services on a Ray cluster (idempotent)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import ray
from ray.actor import ActorHandle

from raykv.config.options import RaykvConfig
from raykv.core import naming, signals
from raykv.core.errors import RaykvError
from raykv.core.factory import tier_instance_key
from raykv.core.fields import check_ray_address
from raykv.core.identity import KVIdentity
from raykv.core.named import find_actor, named_actor, raykv_running
from raykv.core.node import process_node_id
from raykv.core.outcomes import answers_within
from raykv.core.pins import Unpin
from raykv.core.placement import LoadPlanner
from raykv.core.restarting import RESTART_WAIT_S, get_riding_out_restart
from raykv.core.validate import ArgumentError, ConfigError
from raykv.core.wire import HolderInfo, Report
from raykv.directory.agent import start_agent
from raykv.directory.client import AgentClient, DirectoryClient, LookupCache
from raykv.directory.replaced import while_running
from raykv.directory.shard import DirectoryShard
from raykv.directory.shm_view import ViewReader, view_path
from raykv.policy import PolicyCache, PolicyRule, check_rule_tier
from raykv.services import grafana
from raykv.services.joining import join_control, may_stop_after_failure, stop_done
from raykv.services.messages import ControlStats
from raykv.services.pinning import Unpinned, unpin_everywhere
from raykv.services.ray_token import match_cluster_token_auth
from raykv.services.rules_store import drop_added_tiers, drop_rules

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_attached: dict[tuple[str, str], "RaykvServices"] = {}


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


def ensure_ray(address: str | None = None, *, guest: bool = False) -> None:
    """Connect to a running Ray cluster unless this process already is connected.

    ``guest``: this process is someone else's (a vLLM engine's), which handles its
    own signals: joining Ray must not change how it stops
    (``signals.left_alone_by_ray_init``)."""
    if ray.is_initialized():
        return
    problem = None if address is None else check_ray_address(address)
    if problem:
        raise ArgumentError("address", problem)
    check_reachable(address)
    target = address or "auto"
    # ray.init takes RAY_ADDRESS for "auto", as an explicit address; without it Ray finds
    # this machine's cluster and matches the token file itself
    named = os.environ.get("RAY_ADDRESS") if target == "auto" else target
    if named and named not in ("local", "auto") and "://" not in named:
        match_cluster_token_auth(named)
    try:
        with signals.left_alone_by_ray_init() if guest else contextlib.nullcontext():
            ray.init(address=target, log_to_driver=False)
        signals.after_ray_init()
    except ConnectionError as e:
        if target != "auto":  # its port answered (``check_reachable``): Ray refused this process
            raise RaykvError(
                f"could not connect to the Ray cluster at address={target!r} (its port answers): where it "
                "uses token authentication, this machine needs the head's token: `ray "
                "get-auth-token` on its head node, then RAY_AUTH_TOKEN=<token> or ~/.ray/auth_token here"
            ) from e
        raise RaykvError(
            f"no Ray cluster reachable at address={target!r}: start one with "
            "`ray start --head` (or `ray up`), or pass the cluster's address"
        ) from e


def _namespace_problem(namespace: object) -> str | None:
    from raykv.core.fields import check_namespace

    if not isinstance(namespace, str):
        return f"must be str, got {type(namespace).__name__}"
    return check_namespace(namespace)


def _session_key(namespace: str) -> tuple[str, str]:
    return namespace, ray.get_runtime_context().gcs_address


_T = TypeVar("_T")


@dataclass(frozen=True)
class Invalidation:
    """What ``RaykvServices.invalidate`` dropped (``raykv invalidate``)."""

    model: str
    revision: str | None
    #: The identities matched: tag (hex) -> identity.
    identities: dict[str, KVIdentity]
    #: Blocks dropped per holder id.
    per_holder: dict[str, int] = field(default_factory=dict)
    #: Holders not reached: holder id -> why.
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def blocks_dropped(self) -> int:
        return sum(self.per_holder.values())

    def report(self) -> Report:
        """As one JSON object (``raykv invalidate --json``)."""
        per_holder: Report = {k: v for k, v in self.per_holder.items()}
        errors: Report = {k: v for k, v in self.errors.items()}
        identities: Report = {t: identity_report(i) for t, i in self.identities.items()}
        return {
            "model": self.model,
            "revision": self.revision,
            "identities": identities,
            "blocks_dropped": self.blocks_dropped,
            "per_holder": per_holder,
            "errors": errors,
        }


def identity_report(identity: KVIdentity) -> Report:
    """A KV identity's fields as JSON (values JSON cannot hold as ``str``)."""
    report: Report = json.loads(json.dumps(identity.to_dict(), default=str))
    return report


class RaykvServices:
    """Handles to one namespace's raykv services, shared within a process."""

    def __init__(self, config: RaykvConfig, control: ActorHandle, shards: list[ActorHandle]) -> None:
        self.config = config
        self.namespace = config.namespace
        self.control = control
        self.directory = DirectoryClient(shards, self.namespace)
        self._lookup_cache: LookupCache | None = None
        self._policy: PolicyCache | None = None
        self._identities_sent: dict[bytes, KVIdentity] = {}
        #: Which tier of this process loads which holder's blocks (``raykv.core.placement``).
        self.planner = LoadPlanner(self.node_id())

    @property
    def lookup_cache(self) -> LookupCache:
        """This process's directory answers (made on first use: with the node's
        agent and its shared view when ``directory_agent`` is on)."""
        if self._lookup_cache is None:
            config = self.config
            client: DirectoryClient | AgentClient = self.directory
            view = None
            if getattr(config, "directory_agent", False):
                restart = while_running(self.namespace, self.directory_agent)
                client = AgentClient(self.directory_agent(), self.directory.num_shards, restart=restart)
                view = ViewReader(view_path(self.namespace, self.node_id()))
            self._lookup_cache = LookupCache(
                client, ttl_s=config.lookup_ttl_s, max_entries=config.lookup_cache_entries, view=view
            )
        return self._lookup_cache

    def directory_agent(self, node_id: str | None = None) -> ActorHandle:
        """The directory agent of ``node_id`` (this process's node), started when missing."""
        return start_agent(
            self.namespace,
            node_id or self.node_id(),
            self.directory.shards,
            float(getattr(self.config, "agent_window_ms", 2.0)),
            int(getattr(self.config, "agent_view_keys", 1_000_000)),
            all_keys=bool(getattr(self.config, "agent_view_all_keys", True)),
        )

    def directory_agents(self) -> dict[str, ActorHandle]:
        """The running directory agents of this namespace, by node id."""
        agents = {}
        for name in _named_actors(self.namespace):
            if name.startswith(naming.DIRECTORY_AGENT_PREFIX):
                handle = find_actor(name, self.namespace)
                if handle is not None:
                    agents[name[len(naming.DIRECTORY_AGENT_PREFIX) :]] = handle
        return agents

    @property
    def policy(self) -> PolicyCache:
        """The policy-rule cache (its background refresh starts on first use)."""
        if self._policy is None:
            namespace = self.namespace
            self._policy = PolicyCache(
                self.control,
                self.config.policy_refresh_s,
                find_control=lambda: find_actor(naming.CONTROL_ACTOR, namespace),
                on_control_restart=self._announce_identities,
            )
        return self._policy

    @property
    def restarted(self) -> bool:
        """Whether these services were stopped (``raykv stop``) and raykv started
        again in the namespace since: this process's tiers should attach anew
        (``raykv.engine.reattach``). Read from the policy cache's long poll: no call."""
        policy = self._policy
        return policy is not None and policy.successor is not None

    def retire(self) -> None:
        """Forget these (stopped) services in this process: the next ``attach``
        finds the running ones. Their handles stay valid for whoever holds them."""
        with _lock:
            for key, services in list(_attached.items()):
                if services is self:
                    del _attached[key]
        if self._policy is not None:
            self._policy.close(timeout=0.0)

    @staticmethod
    def node_id() -> str:
        """This process's node (``process_node_id``)."""
        return process_node_id()

    def add_rule(self, rule: Mapping[str, object] | PolicyRule) -> int:
        """Register a policy rule at the control actor; returns the rules version.

        Validated here first (``ConfigError`` naming the field): its ``tier``
        must be ``'*'``, a known tier type, or a type in the running config.
        """
        parsed = rule if isinstance(rule, PolicyRule) else PolicyRule.from_dict(rule, "rule")
        check_rule_tier(parsed.tier, "rule.tier", also=[t.get("type") for t in self.config.tiers])
        return self.call_control("add_rule", int, args=(parsed,))

    def remove_rule(self, name: str) -> int:
        """Remove the rule named ``name`` (none such: nothing changes); returns the rules version."""
        if not isinstance(name, str):
            raise ArgumentError("name", f"must be a rule's name (str), got {type(name).__name__}")
        return self.call_control("remove_rule", int, args=(name,))

    def call_control(
        self,
        method: str,
        answer: type[_T],
        timeout: float | None = None,
        restart_wait_s: float = RESTART_WAIT_S,
        args: tuple[object, ...] = (),
    ) -> _T:
        """A call to the control actor that rides out its restart after a crash
        (``raykv.core.restarting``): only for reads (``holders``, ``identities``,
        ``stats``) and calls that name what they set (``add_rule``, ``remove_rule``).
        ``timeout`` bounds each attempt; ``answer``: the type the method returns."""
        answered = get_riding_out_restart(lambda: getattr(self.control, method).remote(*args), timeout, restart_wait_s)
        return cast(_T, answered)

    def holders(self, timeout: float | None = None) -> list[HolderInfo]:
        """Every announced holder (tier and engine-cache actors)."""
        return self.call_control("holders", list[HolderInfo], timeout)

    def register_identity(self, identity: KVIdentity) -> None:
        """Announce an engine's KV identity to the control actor (once per process, and
        again if the control actor restarts after a crash: the policy poll sees it)."""
        if identity.tag not in self._identities_sent:
            self._identities_sent[identity.tag] = identity
            self.control.register_identity.remote(identity.tag_hex, identity)
        self.policy  # noqa: B018 - starts the long poll that notices a restarted control actor

    def _announce_identities(self) -> None:
        for identity in list(self._identities_sent.values()):
            self.control.register_identity.remote(identity.tag_hex, identity)

    def identities(self, timeout: float | None = None) -> dict[str, KVIdentity]:
        """Announced KV identities: tag (hex) -> identity."""
        return self.call_control("identities", dict[str, KVIdentity], timeout)

    def control_stats(self, timeout: float | None = None) -> ControlStats:
        """The control actor's calls, rules version and holder count."""
        return self.call_control("stats", ControlStats, timeout)

    def invalidate(self, model: str, revision: str | None = None, timeout: float = 60.0) -> Invalidation:
        """Drop every block of the identities of ``model`` (of one ``revision``
        when given) from every tier actor and the directory; returns what went.

        Blocks leave each holder's index and the directory before this
        returns; engines' lookup caches forget them within ``lookup_ttl_s``
        (meanwhile a load of such a key fails and falls back to recompute).
        """
        return invalidate_identities(self, model, revision, timeout)

    def unpin(
        self, tenants: Sequence[str] = (), keys: Sequence[bytes] = (), everything: bool = False, timeout: float = 60.0
    ) -> Unpinned:
        """Drop the pins (``kv_transfer_params['cache_ttl_s']``) of ``tenants``, of
        ``keys`` (scoped tier keys), or all of them, in every tier actor; the
        blocks stay and age under plain LRU. ``ValueError`` when nothing is named."""
        return unpin_everywhere(self.holders(), self.namespace, Unpin(tuple(tenants), tuple(keys), everything), timeout)

    def start_tier_services(self, tier_config: Mapping[str, object], where: str = "tier") -> None:
        """Start the actors a tier config needs (per-node actors, fs root actor)."""
        from raykv.core.factory import TierFactory

        tier_cls, options = TierFactory.parse(tier_config, where)
        start = getattr(tier_cls, "start_services", None)
        if start is None:
            return
        try:
            start(self, options)
        except ConfigError as e:  # a tier names its own field; the user wrote it under `where`
            raise ConfigError(f"{where}.{e.field}", e.message) from None

    def shutdown(self) -> None:
        """Kill every raykv actor of this namespace (their blocks go with them)."""
        holders = self.holders()
        if self._policy is not None:  # stop its long poll first: it would warn that the control actor is gone
            self._policy.close(timeout=0)
        # The control actor first: while it lives, callers start a missing shard, agent or
        # tier actor again (``raykv.directory.replaced``, ``raykv.engine.reattach``).
        ray.kill(self.control)
        for info in holders:
            actor = find_actor(info.actor_name, self.namespace)
            if actor is not None:
                ray.kill(actor)
        # Every agent removes its view at once: one 10 s bound for all nodes, not 10 s per node
        # (a dead agent's call fails at once; its view files go with `raykv stop`'s cleanup).
        agents = list(self.directory_agents().values())
        closes: list[ray.ObjectRef[None]] = [agent.close.remote() for agent in agents]
        if closes:
            ray.wait(closes, num_returns=len(closes), timeout=10)
        for agent in agents:
            ray.kill(agent)
        for shard in self.directory.shards:
            ray.kill(shard)
        kill_named_actors(self.namespace)  # any the registry did not list (a tier actor that never registered)
        if self._policy is not None:
            self._policy.close()
        with _lock:
            _attached.pop(_session_key(self.namespace), None)


def _named_actors(namespace: str) -> list[str]:
    """The names of raykv's named actors in ``namespace`` (all start with ``raykv-``)."""
    names = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if isinstance(entry, dict) and entry.get("namespace") == namespace and entry["name"].startswith("raykv-"):
            names.append(entry["name"])
    return names


def kill_named_actors(namespace: str) -> list[str]:
    """Kill raykv's named actors still alive in ``namespace``; their names."""
    killed = []
    # The control actor first: it starts again any directory shard it finds gone.
    for name in sorted(_named_actors(namespace), key=lambda n: n != naming.CONTROL_ACTOR):
        actor = find_actor(name, namespace)
        if actor is not None:
            ray.kill(actor)
            killed.append(name)
    # A stopped raykv forgets its run-time rules and added tiers: the next start has its config's.
    drop_rules(namespace)
    drop_added_tiers(namespace)
    return killed


@dataclass(frozen=True)
class Stopped:
    """What ``stop`` found in the namespace."""

    namespace: str
    #: Whether raykv ran there (its control actor was alive).
    was_running: bool
    #: raykv actors found without a control actor (a half-stopped raykv), killed.
    leftovers: tuple[str, ...] = ()


def stop(namespace: str = naming.DEFAULT_NAMESPACE, *, address: str | None = None) -> Stopped:
    """Stop raykv in ``namespace``: every raykv actor there goes, with its blocks.
    Stopping a namespace where raykv does not run is not an error (``was_running``
    says so); actors a half-stopped raykv left there are killed too."""
    problem = _namespace_problem(namespace)
    if problem:
        raise ArgumentError("namespace", problem)
    ensure_ray(address)
    if not raykv_running(namespace):
        return Stopped(namespace, False, tuple(kill_named_actors(namespace)))
    attach(namespace).shutdown()
    return Stopped(namespace, True)


def invalidate_identities(services: RaykvServices, model: str, revision: str | None, timeout: float) -> Invalidation:
    """``RaykvServices.invalidate``: match identities, then every holder drops their keys."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model: must be a non-empty str, got {model!r}")
    if revision is not None and not isinstance(revision, str):
        raise ValueError(f"revision: must be a str or None, got {revision!r}")
    known = services.identities()
    tags = sorted(
        tag for tag, ident in known.items() if ident.model == model and (revision is None or ident.revision == revision)
    )
    dropped: dict[str, int] = {}
    errors: dict[str, str] = {}
    if tags:
        calls: dict[str, ray.ObjectRef[int]] = {}
        for info in services.holders():
            actor = find_actor(info.actor_name, services.namespace)
            if actor is not None:
                calls[info.holder_id] = actor.drop_identities.remote([bytes.fromhex(t) for t in tags])
        for holder_id, answer in answers_within(calls, timeout).items():
            if isinstance(answer, int):
                dropped[holder_id] = answer
            else:  # a dead holder's entries already left the directory
                errors[holder_id] = repr(answer)
    return Invalidation(model, revision, {t: known[t] for t in tags}, dropped, errors)


def start(config: RaykvConfig | Mapping[str, object] | None = None, *, address: str | None = None) -> RaykvServices:
    """Start raykv's services (or reuse running ones) and the configured tiers.

    ``config`` (a dict or a ``RaykvConfig``) is validated first: a bad one
    raises ``ConfigError`` naming the field before anything starts.
    """
    config = RaykvConfig.from_dict(config.to_dict() if isinstance(config, RaykvConfig) else config)
    ensure_ray(address)
    ns = config.namespace
    joined = join_control(config)
    control = joined.control
    running: RaykvConfig = get_riding_out_restart(control.config.remote)
    differences = _config_differences(running, config)
    if differences:
        logger.warning(
            "raykv already runs in namespace %r with other settings: %s; keeping them (to change them: "
            "`raykv stop`, then `raykv start`; running engines attach to the new services)",
            ns,
            "; ".join(differences),
        )
    left_out = [_tier_name(t) for t in _tiers_not_in(running.tiers, config.tiers)]
    if left_out:
        logger.warning(
            "raykv in namespace %r runs tiers this config leaves out: %s; they keep running (to stop them: "
            "`raykv stop`, then `raykv start`)",
            ns,
            ", ".join(left_out),
        )
    shards = [
        named_actor(DirectoryShard, naming.directory_shard(i), ns, i, running.directory_shards, ns)
        for i in range(running.directory_shards)
    ]
    ray.get([s.ping.remote() for s in shards])
    services = RaykvServices(running, control, shards)
    with _lock:
        _attached[_session_key(ns)] = services
    started: list[Mapping[str, object]] = []
    try:
        for i, tier in enumerate(config.tiers):
            services.start_tier_services(tier, f"tiers[{i}]")
            started.append(tier)
    except BaseException:  # Ctrl-C too: a start that failed leaves the namespace as it found it
        if may_stop_after_failure(joined):
            try:
                _stop_after_failed_start(services)
            finally:
                stop_done(ns)
        else:  # what runs stays, another start's too: its config lists the tiers that started
            try:
                _list_started_tiers(services, started, running)
            except Exception as e:  # the start's own error matters more
                logger.warning("raykv start failed, and listing the tiers it had started failed too: %r", e)
        raise
    _list_started_tiers(services, started, running)
    grafana.provision()
    return services


def _list_started_tiers(services: RaykvServices, started: Sequence[Mapping[str, object]], running: RaykvConfig) -> None:
    """Add the tiers this start ``started`` to the namespace's config (``add_tiers``),
    leaving out those ``running`` lists already."""
    added = _tiers_not_in(started, running.tiers)
    if added:
        services.config = get_riding_out_restart(lambda: services.control.add_tiers.remote(added))


def _stop_after_failed_start(services: RaykvServices) -> None:
    """Stop the services a failed first ``start`` started (the error raised says why it failed)."""
    try:
        services.shutdown()
    except Exception as e:  # the start's own error matters more: say what may be left
        logger.warning(
            "raykv start failed, and stopping what it had started in namespace %r failed too (%r): "
            "`raykv stop --namespace %s` stops what is left",
            services.namespace,
            e,
            services.namespace,
        )
        return
    logger.warning(
        "raykv start failed: stopped what it had started in namespace %r (nothing of it is left running)",
        services.namespace,
    )


def _tiers_not_in(
    tiers: Sequence[Mapping[str, object]], others: Sequence[Mapping[str, object]]
) -> list[dict[str, object]]:
    """The tier configs of ``tiers`` that name no tier of ``others`` (``tier_instance_key``)."""
    known = {_tier_key(t) for t in others}
    return [dict(t) for t in tiers if _tier_key(t) not in known]


def _tier_key(tier: Mapping[str, object]) -> tuple[str, object]:
    try:
        return tier_instance_key(tier)
    except ConfigError:  # a running tier whose class this process cannot import: its config names it
        return str(tier.get("type")), repr(sorted(tier.items(), key=lambda kv: kv[0]))


def _tier_name(tier: Mapping[str, object]) -> str:
    """A tier as an operator wrote it: its type, and its fs root when it has one."""
    root = tier.get("root")
    return f"{tier.get('type')} {root}" if root is not None else str(tier.get("type"))


def _config_differences(running: RaykvConfig, asked: RaykvConfig) -> list[str]:
    """The cluster-wide settings of ``asked`` that the running services do not have,
    as ``"name running (asked value)"``. Tiers are not compared: ``start`` starts the
    asked ones beside the running ones."""
    have, want = running.to_dict(), asked.to_dict()
    return [
        f"{name} {have.get(name)!r} (asked {value!r})"
        for name, value in want.items()
        if name != "tiers" and have.get(name) != value
    ]


def attached_services() -> list[RaykvServices]:
    """The services this process has attached to or started (one per namespace and Ray session)."""
    with _lock:
        return list(_attached.values())


def attach(
    namespace: str = naming.DEFAULT_NAMESPACE,
    *,
    address: str | None = None,
    start_if_missing: bool = False,
) -> RaykvServices:
    """Connect to the raykv services running in ``namespace``.

    With ``start_if_missing`` a default raykv is started when none runs (what
    engine replicas do); otherwise a missing raykv is an error.
    """
    problem = _namespace_problem(namespace)
    if problem:
        raise ArgumentError("namespace", problem)
    ensure_ray(address)
    key = _session_key(namespace)
    with _lock:
        if key in _attached:
            return _attached[key]
    control = find_actor(naming.CONTROL_ACTOR, namespace)
    if control is None:
        if start_if_missing:
            # A mistyped namespace lands here too: say so, where the engine's log shows it.
            logger.warning(
                "raykv was not running in Ray namespace %r: started it with the default settings "
                "(`raykv start --config` sets them; `raykv status --namespace %s` shows it)",
                namespace,
                namespace,
            )
            return start({"namespace": namespace})
        raise RaykvError(
            f"raykv is not running in Ray namespace {namespace!r}: run `raykv start` (or raykv.start()) first"
        )
    config: RaykvConfig = get_riding_out_restart(control.config.remote)
    shards = []
    for i in range(config.directory_shards):
        shard = find_actor(naming.directory_shard(i), namespace)
        if shard is None:
            shard = named_actor(
                DirectoryShard, naming.directory_shard(i), namespace, i, config.directory_shards, namespace
            )
        shards.append(shard)
    services = RaykvServices(config, control, shards)
    with _lock:
        return _attached.setdefault(key, services)
