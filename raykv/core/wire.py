"""The messages raykv's processes send each other, typed on both sides.

Every value that crosses an actor call between raykv's parts is one of these
(or a plain bytes / int / str / list of them): engines and holder actors,
holders and directory shards, everyone and the control actor. Each is a frozen
dataclass or a ``NamedTuple`` that both sides import, so a field renamed on
one side is a type error on the other, not a ``KeyError`` at run time. Tiers
with messages of their own keep them in their package (``tiers/<name>/``) the
same way.

Reports that are read by people and tools rather than code (``stats``,
``describe``: shown by ``raykv status``, dumped as JSON) are ``Report``: a
mapping of names to JSON values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

#: A JSON value (what ``json.dumps`` writes).
JsonValue: TypeAlias = "str | int | float | bool | None | list[JsonValue] | dict[str, JsonValue]"
#: A report for people and tools (``raykv status``, ``stats()``): names to JSON values.
Report: TypeAlias = "dict[str, JsonValue]"

PLASMA = "plasma"  # node-local Ray object store
SHARED = "shared"  # shared storage reachable from every node
ENGINE = "engine"  # an engine's own (accelerator) KV cache: routed to, never loaded from
PENDING = "pending"  # blocks an engine is computing now: waited for, never loaded from


@dataclass(frozen=True)
class HolderInfo:
    """One actor that holds blocks (an object-store node actor, an fs root, an engine's cache)."""

    holder_id: str
    tier_type: str
    medium: str  # PLASMA, SHARED or ENGINE
    actor_name: str
    namespace: str
    node_id: str | None = None
    #: The Ray actor that runs the engine (a Serve replica), for ENGINE holders.
    owner: str | None = None


class LookupReply(NamedTuple):
    """A directory shard's answer to ``lookup``."""

    #: Per key asked, its holder-set id (uint32 blob, in the order asked; 0: nobody).
    set_ids: bytes
    #: The holder slots of each set id used in ``set_ids``.
    sets: dict[int, tuple[int, ...]]
    #: The holders of those slots.
    holders: dict[int, HolderInfo]
    #: The shard's life and its change feed's last entry when it answered
    #: (``raykv.directory.feed``): a view applies the answer in feed order.
    feed_epoch: int = 0
    feed_seq: int = -1


@dataclass(frozen=True)
class StoreAnswer:
    """A holder's answer to a store job: bytes stored, or why nothing new was stored."""

    bytes: int = 0
    error: str | None = None


@dataclass(frozen=True)
class LoadAnswer:
    """A holder's answer to a load job; each key succeeds or fails on its own."""

    #: Positions (in the job's keys) that loaded.
    ok: tuple[int, ...] = ()
    #: Position -> why it did not load.
    errors: Mapping[int, str] = field(default_factory=dict)
    bytes: int = 0


@dataclass(frozen=True)
class HolderReady:
    """A holder actor's answer to ``ready()``: who it is and what it runs with."""

    holder: HolderInfo
    capacity_bytes: int
    #: The capacity its starter asked for (another engine may have started it first).
    requested_capacity_bytes: int
    #: The tier's own description (node, root, ...), for status and logs.
    details: Report = field(default_factory=dict)
    #: The settings it runs with (the tier's frozen dataclass; None: the tier has none).
    settings: object | None = None


@dataclass(frozen=True)
class HoldingsPage:
    """What a holder stored and removed since a reader's sequence number (``raykv.holders.events``).

    ``snapshot`` is every held key of the identity when the reader is new or
    fell behind the log (then ``events`` is empty); otherwise ``events`` are
    ``(removed?, keys)`` in order, keys still scoped."""

    next: int
    snapshot: list[bytes] | None
    events: list[tuple[bool, list[bytes]]]
