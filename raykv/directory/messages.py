"""What a directory shard reports, typed on both sides (``raykv status``, tools, tests).

Lookups and holder announcements cross as ``raykv.core.wire`` types
(``LookupReply``, ``HolderInfo``); these are the shard's own reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


class ShardFigures(TypedDict):
    """What a shard's metrics publish (``raykv.metrics.recorders.publish_shard_metrics``)."""

    num_keys: int
    num_holders: int
    #: Keys looked up, ever.
    looked_up: int
    #: Entries dropped, ever, by reason.
    invalidated: dict[str, int]


@dataclass(frozen=True)
class DroppedHolder:
    """A holder a shard dropped, with its entries."""

    holder_id: str
    keys: int
    reason: str
    at: float  # time.time()


@dataclass(frozen=True)
class RebuildReport:
    """How a (re)started shard re-learned its entries from the live holders."""

    holders: int = 0
    keys: int = 0
    #: ``holder id: error`` of each holder that could not be asked.
    failed: tuple[str, ...] = ()
    seconds: float = 0.0
    #: Why nothing was rebuilt (no control actor yet), if so.
    error: str | None = None


@dataclass(frozen=True)
class ShardStats:
    """A directory shard's ``stats()``."""

    shard: int
    keys: int
    index_bytes: int
    #: Keys listed per holder id.
    holders: dict[str, int]
    #: Calls per method name.
    calls: dict[str, int]
    #: The last holders dropped, oldest first.
    dropped: list[DroppedHolder]
    started_at: float = 0.0
    rebuild: RebuildReport = field(default_factory=RebuildReport)
