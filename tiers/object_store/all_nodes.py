"""Copies of pinned blocks in every node's object store (``raykv warm --all-nodes``).

After ``raykv warm`` pinned a prefix's blocks in the node of the replica that
computed it, ``replicate_pinned``:

1. asks every object store actor of the namespace for the keys it holds
   pinned for the tenant that last at least ``min_seconds_left`` more
   (``pinned_keys``: the pins warm just made or extended);
2. asks the object store actor of every alive node to ``replicate`` those
   keys: each pulls the blocks it lacks from the actors that hold them and
   stores them as its own, pinned for the TTL (``replicating``).

Every replica's first request with the prefix then loads it from its own
node's plasma. A node with no object store actor (no replica of the app
started there) is reported, not started: its settings are the engines'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray

from raykv.core import naming
from raykv.core.tenants import DEFAULT_TENANT
from raykv.core.wire import HolderInfo, JsonValue, Report
from tiers.object_store.messages import TIER_TYPE, ReplicateAnswer

#: What a node without an object store actor is reported with.
NO_ACTOR = "no object store actor on this node (no engine with the object_store tier has started there)"


@dataclass
class Replication:
    """What ``replicate_pinned`` did: the keys sent, and per node its actor's answer."""

    tenant: str
    ttl_s: float
    #: Distinct pinned keys found at the actors (the keys sent to every node).
    keys: int = 0
    #: Node id -> what its actor did.
    per_node: dict[str, ReplicateAnswer] = field(default_factory=dict)
    #: Node id -> why its actor was not reached (none there, dead, timed out).
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def copied(self) -> int:
        return sum(a.copied for a in self.per_node.values())

    @property
    def copied_bytes(self) -> int:
        return sum(a.copied_bytes for a in self.per_node.values())

    def report(self) -> Report:
        """As one JSON object."""
        nodes: list[JsonValue] = [self.per_node[n].report() for n in sorted(self.per_node)]
        return {
            "tenant": self.tenant,
            "keys": self.keys,
            "blocks_copied": self.copied,
            "bytes_copied": self.copied_bytes,
            "per_node": nodes,
            "errors": {n: why for n, why in sorted(self.errors.items())},
        }


def object_store_holders(holders: Sequence[HolderInfo]) -> list[HolderInfo]:
    """The object store node actors among ``holders``."""
    return [h for h in holders if h.tier_type == TIER_TYPE]


def alive_nodes() -> list[str]:
    """The ids of the cluster's alive Ray nodes."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def pinned_keys(
    holders: Sequence[HolderInfo], namespace: str, tenant: str, min_seconds_left: float, timeout: float = 30.0
) -> list[bytes]:
    """The keys the object store actors among ``holders`` hold pinned for
    ``tenant`` with at least ``min_seconds_left`` left (each once, in the
    order the actors answer). ``RuntimeError`` when no actor answers."""
    calls: dict[str, ray.ObjectRef[list[bytes]]] = {}
    for info in object_store_holders(holders):
        actor = _actor(info.actor_name, namespace)
        if actor is not None:
            calls[info.holder_id] = actor.pinned_keys.remote(tenant, min_seconds_left)
    out: dict[bytes, None] = {}
    failed: dict[str, str] = {}
    for holder_id, ref in calls.items():
        try:
            keys: list[bytes] = ray.get(ref, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a dead actor's pins died with it
            failed[holder_id] = repr(e)
            continue
        out.update(dict.fromkeys(keys))
    if calls and len(failed) == len(calls):
        raise RuntimeError(f"no object store actor answered for its pinned keys: {failed}")
    return list(out)


def replicate_pinned(
    holders: Sequence[HolderInfo],
    namespace: str,
    tenant: str | None,
    ttl_s: float,
    min_seconds_left: float,
    nodes: Callable[[], list[str]] = alive_nodes,
    timeout: float = 600.0,
) -> Replication:
    """Copy the blocks the object store actors among ``holders`` hold pinned for
    ``tenant`` (with at least ``min_seconds_left`` left) into the object store
    of every one of ``nodes()``, pinned for ``ttl_s`` seconds; what each did."""
    who = tenant or DEFAULT_TENANT
    out = Replication(who, ttl_s)
    keys = pinned_keys(holders, namespace, who, min_seconds_left)
    out.keys = len(keys)
    if not keys:
        return out
    calls: dict[str, ray.ObjectRef[ReplicateAnswer]] = {}
    for node_id in nodes():
        actor = _actor(naming.object_store_actor(node_id), namespace)
        if actor is None:
            out.errors[node_id] = NO_ACTOR
        else:
            calls[node_id] = actor.replicate.remote(keys, who, ttl_s)
    for node_id, ref in calls.items():
        try:
            out.per_node[node_id] = ray.get(ref, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - one node's failure leaves the others' copies
            out.errors[node_id] = repr(e)
    return out


def _actor(name: str, namespace: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:  # none (or gone)
        return None
