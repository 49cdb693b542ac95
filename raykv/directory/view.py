"""``NodeView``: what one node knows of the directory, kept by its agent.

Two kinds of entries, in one ``FingerprintTable`` (fingerprint -> interned
holder set):

- **local**: every key of this node's own holders (its object store, its
  engines' caches), followed from the shards' change feeds;
- **remote answers**: keys the node's engines asked for, with the answer the
  shards gave (held by somebody, or by nobody), kept up to date by the same
  feeds (a change to a key the view does not know is skipped).

With ``all_keys`` the view takes every key of every holder instead (while the
directory fits in ``max_keys``): once it holds them all (``complete``), a key
it does not list is held by nobody, and lookups need no call at all. Past
``max_keys`` it falls back to the two kinds above.

A slot names one holder *as listed by one shard* (every key lives in exactly
one shard), so a shard that restarts or drops a holder touches only its own
keys. Slots are never reused: a set id means the same holders for as long as
the view lives, which is what lets engines decode a shared copy of it without
a lock (``raykv.directory.shm_view``). Plain Python, no Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np

from raykv.core.wire import PENDING, HolderInfo, LookupReply
from raykv.directory.fingerprint import from_blob
from raykv.directory.fptable import Allocate, FingerprintTable
from raykv.directory.holdersets import HolderSets

logger = logging.getLogger(__name__)


class NodeView:
    """Fingerprint -> holders for one node (``raykv.directory.agent``'s state).

    ``changing`` brackets every change (the shared copy's seqlock); ``on_sets``
    is told when a set id or a holder was added (the engines' decode table).
    """

    def __init__(
        self,
        node_id: str,
        max_keys: int = 1_000_000,
        allocate: Allocate | None = None,
        changing: Callable[[], AbstractContextManager[None]] | None = None,
        all_keys: bool = False,
        on_complete: Callable[[bool], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.max_keys = max_keys
        #: Follow every key (not only local and asked ones) while they fit in ``max_keys``.
        self.all_keys = all_keys
        self._complete = False
        self._on_complete = on_complete
        self.table = FingerprintTable(allocate=allocate)
        self.sets = HolderSets()
        self._slot_of: dict[tuple[int, str], int] = {}
        self.holders: dict[int, HolderInfo] = {}
        self._local: set[int] = set()
        self._changing = changing
        self._holder_changes = 0
        self.resets = 0  # remote answers dropped to stay within max_keys

    # -- writing -------------------------------------------------------------
    @contextmanager
    def change(self) -> Iterator[None]:
        """One change, seen whole or not at all by readers of the shared copy."""
        if self._changing is None:
            yield
        else:
            with self._changing():
                yield

    @property
    def complete(self) -> bool:
        """Every key of every followed shard is in the view: absent means held by nobody.
        Set by the agent once it has read every holder; cleared by a reset or an overflow."""
        return self._complete

    @complete.setter
    def complete(self, value: bool) -> None:
        value = value and self.all_keys
        if value != self._complete:
            self._complete = value
            if self._on_complete is not None:
                self._on_complete(value)

    def slot(self, shard: int, info: HolderInfo) -> int:
        """The view slot of ``info`` as listed by ``shard`` (added when new)."""
        slot = self._slot_of.get((shard, info.holder_id))
        if slot is None:
            slot = self._slot_of[(shard, info.holder_id)] = len(self._slot_of) + 1
        if self.holders.get(slot) != info:
            self.holders[slot] = info
            self._holder_changes += 1
        if self.is_local(info):
            self._local.add(slot)
        return slot

    def is_local(self, info: HolderInfo) -> bool:
        """Whether ``info`` holds blocks on this node (its engines' pending entries hold none)."""
        return info.node_id == self.node_id and info.medium != PENDING

    def listed(self, shard: int) -> list[HolderInfo]:
        """The holders the view knows ``shard`` lists."""
        return [self.holders[slot] for (s, _), slot in self._slot_of.items() if s == shard]

    def drop_holder(self, shard: int, holder_id: str) -> None:
        """``holder_id`` no longer holds anything of ``shard``."""
        slot = self._slot_of.get((shard, holder_id))
        if slot is None:
            return
        values = self.table.values
        hit = np.flatnonzero(np.isin(values, self.sets.containing(slot)))
        if len(hit):
            with self.change():
                values[hit] = self.sets.without_slot(values[hit], slot)

    def register(self, shard: int, holder_id: str, blob: bytes) -> None:
        """``holder_id`` (listed by ``shard``) now holds ``blob``'s keys: every one
        of them when the holder is on this node, else those the view knows."""
        slot = self._slot_of.get((shard, holder_id))
        if slot is None:
            return  # announced before we followed this shard: its snapshot has it
        fps = from_blob(blob)
        if slot in self._local or self.all_keys:
            self._room(len(fps))
            with self.change():
                pos = self.table.upsert(fps)
                values = self.table.values
                values[pos] = self.sets.with_slot(values[pos], slot)
            return
        pos = self.table.find(fps)
        pos = pos[pos >= 0]
        if len(pos):
            with self.change():
                values = self.table.values
                values[pos] = self.sets.with_slot(values[pos], slot)

    def unregister(self, shard: int, holder_id: str, blob: bytes) -> None:
        slot = self._slot_of.get((shard, holder_id))
        if slot is None:
            return
        pos = self.table.find(from_blob(blob))
        pos = pos[pos >= 0]
        if len(pos):
            with self.change():
                values = self.table.values
                values[pos] = self.sets.without_slot(values[pos], slot)

    def learn(self, shard: int, fps: np.ndarray, reply: LookupReply) -> np.ndarray:
        """Keep ``shard``'s answer for ``fps`` (distinct); returns their view set ids."""
        ids = self.translate(shard, reply)
        self._room(len(fps))
        with self.change():
            pos = self.table.upsert(fps)
            self.table.values[pos] = ids
        return ids

    def translate(self, shard: int, reply: LookupReply) -> np.ndarray:
        """``reply``'s per-key set ids as view set ids (holders added as needed)."""
        lut = np.zeros(max(reply.sets, default=0) + 1, dtype=np.uint32)
        for set_id, slots in reply.sets.items():
            lut[set_id] = self.sets.intern(frozenset(self.slot(shard, reply.holders[s]) for s in slots))
        return lut[np.frombuffer(reply.set_ids, dtype="<u4")]

    def reset(self) -> None:
        """Forget every key (a shard's feed had a gap: its keys can no longer be followed)."""
        with self.change():
            self.complete = False
            self.table.values[:] = 0
            self.table.compact()  # every slot is dead now: the smallest table
            self.resets += 1

    def _room(self, n: int) -> None:
        """Room for ``n`` more keys; past ``max_keys``, remote answers go first."""
        # ``used`` counts live and dead slots: only near the cap is the live count worth counting
        if self.table.used + n > self.max_keys and self.live_keys() + n > self.max_keys:
            if self.all_keys:  # the directory no longer fits: back to local + asked keys
                logger.warning(
                    "directory view of node %s: over %d keys; keeping only this node's and asked keys",
                    self.node_id[:12],
                    self.max_keys,
                )
            with self.change():
                self.all_keys = self.complete = False
                values = self.table.values
                values[~self._local_sets()[values]] = 0
                self.table.compact(n)
                self.resets += 1
        # A rebuild fills a new table that readers do not see yet (a shared view's allocator):
        # they read the current one meanwhile, and are sent to the new one by a change.
        if self.table.reserve(n):
            with self.change():
                pass

    # -- reading -------------------------------------------------------------
    @property
    def version(self) -> int:
        """Changes whenever a set id or a holder is added (what engines decode with):
        set ids only ever grow, and a slot's holder changes only by re-announcing."""
        return (len(self.sets) << 32) | self._holder_changes

    def lookup(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per fingerprint: whether the view knows it, and its set id (0: nobody)."""
        pos = self.table.find(fps)
        known = pos >= 0
        return known, np.where(known, self.table.values[pos], 0).astype(np.uint32)

    def reply(self, ids: np.ndarray) -> LookupReply:
        """View set ids as a ``LookupReply`` (engines decode it like a shard's)."""
        sets = {int(i): tuple(sorted(self.sets.slots(int(i)))) for i in self.sets.present(ids.astype(np.int64)) if i}
        used: set[int] = set().union(*sets.values()) if sets else set()
        return LookupReply(ids.astype("<u4").tobytes(), sets, {s: self.holders[s] for s in used})

    def live_keys(self) -> int:
        """Keys some holder holds (known-nobody entries not counted)."""
        return int(np.count_nonzero(self.table.values))

    def known_keys(self) -> int:
        """Keys the view can answer (known-nobody entries included)."""
        return int(np.count_nonzero(self.table.flat_fps))

    def _local_sets(self) -> np.ndarray:
        """Per set id: whether one of this node's holders is in it."""
        local = np.zeros(len(self.sets), dtype=bool)
        for slot in self._local:
            local[self.sets.containing(slot)] = True
        return local

    def local_keys(self) -> int:
        if not self._local:
            return 0
        return int(np.count_nonzero(self._local_sets()[self.table.values]))

    def decode_table(self) -> tuple[dict[int, HolderInfo], list[tuple[int, ...]]]:
        """What engines decode set ids with: slot -> holder, and each set id's slots."""
        return dict(self.holders), [tuple(sorted(self.sets.slots(i))) for i in range(len(self.sets))]
