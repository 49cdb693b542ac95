"""What the fs tier's engines and a root's actor send each other, typed on both sides.

- ``FsRootSettings``: what a root's ``FsRootActor`` runs with (built by
  ``FsOptions.actor_settings``, taken by the actor); the one place its
  defaults are stated.
- ``CommitBatch`` / ``CommitReport``: block files engines wrote (or found
  present), sent in one ``commit`` per control round, and which of them did
  not stay.

``pin`` takes a ``raykv.core.pins.PinBatch`` and ``unpin`` an ``Unpin`` (both
answer how many blocks). The other calls carry plain values: ``touch(keys)``, ``remove(keys, reason,
details) -> int``, ``set_capacity(bytes) -> list[bytes]``,
``drop_identities(tags) -> int``; ``describe`` / ``tier_stats`` are
``raykv.core.wire.Report``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from raykv.core.pins import DEFAULT_MAX_PINNED_FRACTION

GiB = 1024**3
#: Default capacity of a root (the tier's ``capacity_bytes`` option).
DEFAULT_CAPACITY_BYTES = 64 * GiB


@dataclass(frozen=True)
class FsRootSettings:
    """How a root's actor runs (fixed when the actor starts; ``set_capacity`` changes the capacity)."""

    #: The root, canonical (``storage.canonical_root``).
    root: str
    #: Bytes of block files kept under the root (LRU, file sizes incl. headers); 0: unlimited.
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES
    #: Bytes of block files each tenant may keep (``raykv.core.tenants``); empty: no quotas.
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)
    #: Temp files (a writer's unfinished store) older than this are removed: at start-up, then every quarter of it.
    tmp_max_age_s: float = 3600.0
    #: Largest share of the capacity pinned files may take (``raykv.core.pins``; no cap when unlimited).
    max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION


@dataclass(frozen=True)
class CommitBatch:
    """Keys whose block files engines wrote (or found present), one entry per key."""

    keys: tuple[bytes, ...]
    #: File size of each key (header included).
    sizes: tuple[int, ...]
    #: Tenant each key is charged to.
    tenants: tuple[str, ...]
    #: Keys an engine did not write because their file existed: the actor checks
    #: on disk those its index lacks (the file may have been evicted since).
    verify: frozenset[bytes] = frozenset()
    #: Seconds to pin each key (``raykv.core.pins``; 0: unpinned); empty: none pinned.
    ttls: tuple[float, ...] = ()


@dataclass(frozen=True)
class CommitReport:
    """Which keys of a ``CommitBatch`` did not stay."""

    #: Evicted to stay within capacity (may include keys of the batch itself).
    evicted: tuple[bytes, ...] = ()
    #: In ``verify`` but their file was gone.
    missing: tuple[bytes, ...] = ()
