"""Holders: tier actors that own blocks and register them at the directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PLASMA = "plasma"  # node-local Ray object store
SHARED = "shared"  # shared storage reachable from every node


@dataclass(frozen=True)
class HolderInfo:
    """One tier actor that holds blocks (an object-store node actor, an fs root)."""

    holder_id: str
    tier_type: str
    medium: str  # PLASMA or SHARED
    actor_name: str
    namespace: str
    node_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HolderInfo":
        return cls(**d)


def preference(holder: HolderInfo, node_id: str | None) -> int:
    """Lower is better: same node, then shared storage, then another node's plasma."""
    if holder.medium == PLASMA and holder.node_id == node_id:
        return 0
    if holder.medium == SHARED:
        return 1
    return 2
