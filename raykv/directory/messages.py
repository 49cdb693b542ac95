"""What a directory shard reports, typed on both sides (``raykv status``, tools, tests).

Lookups and holder announcements cross as ``raykv.core.wire`` types
(``LookupReply``, ``HolderInfo``); these are the shard's own reports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, TypedDict

from raykv.core.wire import HolderInfo, LookupReply


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
    #: Keys some holder holds (pending entries, blocks being computed, not counted).
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
    #: Pending entries: blocks engines are computing now (``raykv.holders.pending``).
    pending_keys: int = 0


class FeedOp(enum.IntEnum):
    """What one change-feed entry did (``raykv.directory.feed``)."""

    ADD_HOLDER = 1
    DROP_HOLDER = 2
    REGISTER = 3
    UNREGISTER = 4


class FeedEntry(NamedTuple):
    """One change of a shard: ``op`` on ``holder_id``'s keys ``fps`` (a fingerprint blob)."""

    seq: int
    op: FeedOp
    holder_id: str
    fps: bytes = b""
    #: The holder, for ``ADD_HOLDER``.
    info: HolderInfo | None = None
    #: When the shard made the change (``time.time()``): the views' replica lag.
    at: float = 0.0


@dataclass(frozen=True)
class FeedPage:
    """A shard's answer to ``changes``: the entries after the reader's last one, up to ``seq``."""

    epoch: int
    seq: int
    entries: tuple[FeedEntry, ...]
    #: The reader must start over: drop what it learnt from this shard, take
    #: ``holders`` as the shard's holders now and follow from ``seq``.
    gap: bool = False
    holders: tuple[HolderInfo, ...] = ()


@dataclass(frozen=True)
class AgentStats:
    """A node's directory agent's ``stats()`` (``raykv status``, tests, the directory bench)."""

    node_id: str
    window_ms: float
    #: Keys the view knows (held somewhere or known held by nobody), and its bytes.
    view_keys: int
    view_bytes: int
    #: Keys of this node's own holders in the view.
    local_keys: int
    #: Engine lookup calls taken, and keys in them (keys an engine's view read settled never come here).
    lookups: int
    keys_asked: int
    #: Calls made to the shards (lookups, feed reads) and engine calls merged into them.
    shard_calls: dict[str, int]
    #: Feed entries applied, gaps (view parts dropped and re-read), views reset.
    feed_entries: int
    gaps: int
    resets: int
    #: Replica lag: seconds from a change at a shard to the view, p50 and p99 of recent ones (None: none yet).
    lag_p50_s: float | None
    lag_p99_s: float | None
    started_at: float = 0.0
    #: Holders' register / unregister calls taken.
    holder_changes: int = 0
    #: What the view holds: "all" (every key of the directory: a key not listed is held by
    #: nobody), "filling" (every key, not all read yet) or "asked" (own holders' and asked keys).
    view_scope: str = "asked"
    #: Whether the node's engines read the view in ``/dev/shm`` (False: it had no room
    #: there, and they ask the agent for every lookup).
    view_shared: bool = True

    def summary(self) -> str:
        """View size, calls and lag, one line (the agent's status log)."""
        p50, p99 = self.lag_p50_s, self.lag_p99_s
        lag = "no changes yet" if p99 is None or p50 is None else f"lag p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms"
        return (
            f"directory agent of node {self.node_id[:12]}: view {self.view_keys} keys ({self.local_keys} local, "
            f"{self.view_scope}{'' if self.view_shared else ', not in /dev/shm: no room'}); "
            f"{self.lookups} engine lookups + {self.holder_changes} holder changes "
            f"-> {self.shard_calls.get('apply', 0)} shard calls; {lag}; {self.resets} resets"
        )


class KeyOp(NamedTuple):
    """One holder's keys registered or unregistered (``op``: REGISTER or UNREGISTER)."""

    op: FeedOp
    holder_id: str
    #: Fingerprint blob (``fingerprint.to_blob``).
    fps: bytes


@dataclass(frozen=True)
class ShardBatch:
    """A node agent's combined call to one shard for one window: key changes, applied
    in order, then one lookup (``lookup``: a fingerprint blob; empty: none).
    ``follow``: the agent's feed position (epoch, seq): the reply then carries the
    feed page after it, so a busy agent needs no separate ``changes`` call."""

    ops: tuple[KeyOp, ...] = ()
    lookup: bytes = b""
    follow: tuple[int, int] | None = None


@dataclass(frozen=True)
class ShardBatchReply:
    """Per op the keys it changed, the lookup's answer (None when none was asked) and
    the feed page after the batch's ``follow`` position, its changes included (None: not asked)."""

    counts: tuple[int, ...]
    lookup: LookupReply | None
    page: FeedPage | None = None
