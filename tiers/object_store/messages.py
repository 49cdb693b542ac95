"""What the object store tier's actors are sent and answer, typed on both sides.

- ``ObjectStoreSettings``: what a node's actor runs with (built by
  ``ObjectStoreOptions.actor_settings``, taken by ``ObjectStoreActor``); the
  one place its defaults are stated.
- ``holder_info``: the directory holder of a node's actor.
- ``PackRef``: where some of a load's blocks are: one pack's ObjectRef and the
  blocks of it wanted. ``get_refs`` answers a list of them to another node's
  actor, which pulls the packs through Ray's object manager.

Store and load jobs answer ``raykv.core.wire.StoreAnswer`` / ``LoadAnswer``
(they take a ``RegionHandle``, keys, chunk ids and, for a load, the hint
``sources``: actor name -> positions; a store also the tenant and the pin TTL).
``pin`` takes a ``raykv.core.pins.PinBatch`` and ``unpin`` an ``Unpin`` (both
answer how many blocks). ``replicate(keys, tenant, cache_ttl_s)`` copies blocks
other nodes' actors hold into this node's plasma and answers a
``ReplicateAnswer`` (``raykv warm --all-nodes``). The other calls carry plain
values: ``touch(keys) -> int``, ``holds(keys) -> list[bool]``,
``pinned_keys(tenant, min_seconds_left) -> list[bytes]``,
``drop_identities(tags) -> int``; ``describe`` / ``tier_stats`` are
``raykv.core.wire.Report``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from raykv.core import naming
from raykv.core.pins import DEFAULT_MAX_PINNED_FRACTION
from raykv.core.wire import PLASMA, HolderInfo, Report
from tiers.object_store.packing import PIECE_BYTES

GiB = 1024**3
MiB = 1024**2

TIER_TYPE = "object_store"


def holder_info(node_id: str, namespace: str) -> HolderInfo:
    """The directory holder of a node's object store actor."""
    return HolderInfo(
        f"{TIER_TYPE}:{node_id}", TIER_TYPE, PLASMA, naming.object_store_actor(node_id), namespace, node_id
    )


@dataclass(frozen=True)
class ObjectStoreSettings:
    """How a node's object store actor runs (fixed when the actor starts)."""

    #: Bytes of blocks the actor keeps in plasma (LRU by pack); 0 stores nothing.
    capacity_bytes: int = 1 * GiB
    #: Largest share of the node's object store the capacity may take.
    max_object_store_fraction: float = 0.8
    #: Largest plasma object; a store job's blocks are split into packs of at most this.
    max_pack_bytes: int = 64 * MiB
    #: Largest buffer handed to ``ray.put`` inside a pack (``packing``).
    piece_bytes: int = PIECE_BYTES
    #: Longest wait for another node's actor or a pull of its packs.
    remote_timeout_s: float = 30.0
    #: Bytes each tenant may keep (``raykv.core.tenants``); empty: no quotas.
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)
    #: Largest share of the capacity pinned blocks may take (``raykv.core.pins``).
    max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION


#: The defaults, for the tier's options (stated once, above).
DEFAULT_SETTINGS = ObjectStoreSettings()


class PackRef(NamedTuple):
    """Some blocks of one pack: its ObjectRef and where each wanted block is."""

    #: The pack's ObjectRef (an opaque handle outside the actor: see ``PackStore``).
    ref: object
    #: The pack's pieces' cumulative end offsets (``packing.piece_ends``).
    ends: list[int]
    block_bytes: int
    #: (position in the keys asked, index of the block in the pack).
    items: list[tuple[int, int]]


@dataclass(frozen=True)
class ReplicateAnswer:
    """What one node's actor's ``replicate`` did with the keys it was sent.

    Every distinct key counts once: in ``copied`` (pulled from another node's
    actor and stored here), ``held`` (here already; its pin extended),
    ``not_found`` (no other node's actor had it, or its pull failed) or
    ``not_stored`` (found, but no room here: ``error`` says why).
    """

    node_id: str
    copied: int = 0
    copied_bytes: int = 0
    held: int = 0
    not_found: int = 0
    not_stored: int = 0
    #: Blocks pinned or whose pins were extended (copied and held ones).
    pinned: int = 0
    #: Blocks stored but left unpinned, per reason (``raykv.core.pins``: tier_cap, tenant_quota).
    pins_refused: Mapping[str, int] = field(default_factory=dict)
    #: Why found blocks were not stored (no room, over the tier or tenant's capacity, put failed).
    error: str | None = None

    @property
    def refused(self) -> int:
        """Blocks not stored plus blocks stored unpinned."""
        return self.not_stored + sum(self.pins_refused.values())

    def report(self) -> Report:
        """As one JSON object."""
        return {
            "node_id": self.node_id,
            "copied": self.copied,
            "copied_bytes": self.copied_bytes,
            "held": self.held,
            "not_found": self.not_found,
            "not_stored": self.not_stored,
            "pinned": self.pinned,
            "pins_refused": {**self.pins_refused},
            "error": self.error,
        }
