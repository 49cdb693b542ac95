"""``RootIndex``: what a root holds, kept by its actor (no Ray, no I/O).

Key -> file size in least-recently-used order, the bytes they take, each
tenant's share (``raykv.core.tenants``) and the capacity. Commits, scans,
touches and removals change it; each change answers which keys it evicted or
dropped, and the actor turns those into directory calls and file deletions.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

from raykv.core.pins import DEFAULT_MAX_PINNED_FRACTION, PinBatch, PinOutcome, Unpin, pin_keys
from raykv.core.tenants import DEFAULT_TENANT, TenantLRU
from tiers.fs.messages import CommitBatch
from tiers.fs.storage import FileEntry


class Committed(NamedTuple):
    """What a commit changed in the index."""

    #: Keys of the batch now held (to register at the directory).
    held: list[bytes]
    #: Of those, the ones the index did not hold before (stored events).
    new: list[bytes]
    #: Keys evicted to stay within capacity (the batch's own keys included).
    evicted: list[bytes]
    #: Keys of the batch the index did not hold before, evicted or not.
    added: int
    #: The batch's pins (``CommitBatch.ttls``): granted and refused.
    pins: PinOutcome


class RootIndex:
    """The block files of one root the actor accounts for."""

    def __init__(
        self,
        capacity_bytes: int,
        tenant_quotas: Mapping[str, int] | None = None,
        max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: Bytes of block files kept; 0: unlimited.
        self.capacity = int(capacity_bytes)
        #: Bytes per tenant, each tenant's LRU, quotas, pins. Files carry no
        #: tenant nor pin: the ones a scan finds belong to the default tenant, unpinned.
        self.tenants = TenantLRU(tenant_quotas, max_pinned_fraction, clock)
        self.bytes = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def keys(self) -> list[bytes]:
        """Every held key, least recently used first."""
        return list(self._sizes)

    def with_prefix(self, prefixes: Sequence[bytes]) -> list[bytes]:
        """Held keys that start with one of ``prefixes`` (KV identity tags)."""
        tags = tuple(prefixes)
        return [k for k in self._sizes if k.startswith(tags)]

    def adopt(self, entries: Iterable[FileEntry]) -> list[bytes]:
        """Take in the files a scan found (oldest mtime least recently used: it
        stands in for last use); returns the keys evicted to fit the capacity."""
        for e in sorted(entries, key=lambda e: e.mtime):
            if e.key not in self._sizes:
                self._sizes[e.key] = e.size
                self.bytes += e.size
                self.tenants.add(e.key, DEFAULT_TENANT, e.size)
        return self.evict()

    def commit(self, batch: CommitBatch, missing: Collection[bytes] = ()) -> Committed:
        """Hold the batch's keys (but ``missing`` ones: their file is gone),
        most recently used, then evict over capacity and quotas, then pin the
        ones kept that the batch pins (``CommitBatch.ttls``)."""
        held: list[bytes] = []
        new: list[bytes] = []
        for key, size, tenant in zip(batch.keys, batch.sizes, batch.tenants):
            if key in missing:
                continue
            self.tenants.add(key, tenant, size)  # a held key keeps its first tenant
            old = self._sizes.get(key)
            if old is None:
                new.append(key)
            self.bytes += size - (old or 0)
            self._sizes[key] = size
            self._sizes.move_to_end(key)
            held.append(key)
        evicted = self.evict(batch.tenants)
        gone = set(evicted)
        pins = self.pin(PinBatch(batch.keys, batch.ttls)) if batch.ttls else PinOutcome()
        kept = [k for k in held if k not in gone]
        return Committed(kept, [k for k in new if k not in gone], evicted, len(new), pins)

    def pin(self, batch: PinBatch) -> PinOutcome:
        """Touch and pin the held keys of ``batch`` for their TTLs (or extend
        their pins); each file is pinned or refused on its own."""
        out = PinOutcome()
        for ttl, keys in batch.by_ttl().items():
            self.touch(keys)
            out.add(self.tenants.pin(pin_keys(keys), ttl, self.capacity))
        return out

    def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names; the files age under LRU again."""
        return self.tenants.unpin(which)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark keys recently used (those not held are ignored)."""
        keys = list(keys)
        for k in keys:
            if k in self._sizes:
                self._sizes.move_to_end(k)
        self.tenants.touch(keys)

    def drop(self, keys: Iterable[bytes]) -> list[bytes]:
        """Forget keys; returns the ones that were held."""
        dropped = []
        for k in keys:
            size = self._sizes.pop(k, None)
            if size is not None:
                self.bytes -= size
                self.tenants.discard(k)
                dropped.append(k)
        return dropped

    def set_capacity(self, capacity_bytes: int) -> list[bytes]:
        """A new capacity; returns the keys evicted to fit it."""
        self.capacity = int(capacity_bytes)
        return self.evict()

    def evict(self, tenants: Sequence[str] = ()) -> list[bytes]:
        """Evict to stay within capacity (and, for ``tenants`` committing now,
        their quotas; ``raykv.core.tenants``). With quotas, another tenant's files
        within its quota go only when no committing tenant is named (a restart's
        scan, a smaller capacity). Pinned files never go: when only they are
        left the index stays over capacity until they expire. Returns the
        evicted keys, oldest first."""
        out: list[bytes] = []
        quotas = bool(self.tenants.quotas)
        committing = list(dict.fromkeys(tenants)) if quotas else []
        for t in committing:
            while (victim := self.tenants.own_victim(t, 0)) is not None:
                self._pop(victim, out)
        while 0 < self.capacity < self.bytes and self._sizes:
            victim = self.tenants.shared_victim(None) if quotas else None
            if victim is None and quotas:
                victim = next((v for t in committing if (v := self.tenants.shared_victim(t))), None)
            if victim is None:
                victim = self.tenants.oldest() if self.tenants.pins else next(iter(self._sizes))
            if victim is None:
                break  # only pinned files are left
            self._pop(victim, out)
        return out

    def _pop(self, key: bytes, out: list[bytes]) -> None:
        self.bytes -= self._sizes.pop(key)
        self.tenants.discard(key)
        out.append(key)
