"""Placement: which holder a block is loaded from, decided in one place.

- ``HolderInfo`` (from ``raykv.core.wire``, re-exported): a tier actor that
  holds blocks and registers them at the directory (an object store node
  actor, an fs root actor, an engine's own cache).
- ``preference`` / ``choose``: the one rule for "which holder serves this
  key": this node's plasma, then shared storage, then another node's plasma.
  Engines (lookup, load planning), holder actors (finding a block's peer) and
  tools all ask ``choose``.
- ``LoadPlanner``: an engine process's tiers, so a lookup answers HIT in
  exactly the tier that would load from the chosen holder.
- Reading the directory's answers: a shard replies per key with a holder-set
  id, plus the sets and their holders (``holder_codes``, ``decode_reply``);
  ``prefix_of`` / ``prefix_from_codes`` give the leading run of held keys.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from raykv.core.wire import ENGINE, PLASMA, SHARED, HolderInfo, LookupReply

__all__ = [
    "ENGINE",
    "PLASMA",
    "SHARED",
    "HolderInfo",
    "LoadPlanner",
    "Loader",
    "LookupReply",
    "PrefixHit",
    "choose",
    "decode_reply",
    "holder_codes",
    "prefix_from_codes",
    "prefix_of",
    "preference",
]


def preference(holder: HolderInfo, node_id: str | None) -> int:
    """Lower is better: same node's plasma, then shared storage, then another
    node's plasma; an engine's own cache last (no tier loads from it)."""
    if holder.medium == PLASMA and holder.node_id == node_id:
        return 0
    if holder.medium == SHARED:
        return 1
    if holder.medium == ENGINE:
        return 3
    return 2


def choose(
    holders: Sequence[HolderInfo], node_id: str | None, usable: Callable[[HolderInfo], bool] | None = None
) -> HolderInfo | None:
    """The holder a load on ``node_id`` should read: the most preferred of
    ``holders`` that ``usable`` accepts (all when None); None when none is."""
    if usable is not None:
        holders = [h for h in holders if usable(h)]
    if not holders:
        return None
    if len(holders) == 1:
        return holders[0]
    return min(holders, key=lambda h: preference(h, node_id))


class Loader(Protocol):
    """A tier of an engine, as the ``LoadPlanner`` sees it."""

    def can_load(self, holder: HolderInfo) -> bool:
        """Whether this tier can read blocks of ``holder`` now (reachable, and its actor alive)."""
        ...


class LoadPlanner:
    """The tiers of one engine process, per KV identity: for a key's holders,
    the holder to load from (``choose`` over what some tier can read). A tier
    answers HIT only when it can read that holder, so a block is loaded from
    the best place the engine reaches, by the tier that reads it."""

    def __init__(self, node_id: str | None) -> None:
        self.node_id = node_id
        self._lock = threading.Lock()
        self._loaders: dict[bytes, list[Loader]] = {}

    def add(self, tag: bytes, loader: Loader) -> None:
        with self._lock:
            self._loaders.setdefault(tag, []).append(loader)

    def remove(self, tag: bytes, loader: Loader) -> None:
        with self._lock:
            loaders = self._loaders.get(tag, [])
            if loader in loaders:
                loaders.remove(loader)

    def source(self, tag: bytes, holders: Sequence[HolderInfo]) -> HolderInfo | None:
        """The holder a key of identity ``tag`` is loaded from: ``choose`` over
        the holders some tier of the process can read (None: a miss)."""
        loaders = self._loaders.get(tag, ())
        return choose(holders, self.node_id, lambda h: any(t.can_load(h) for t in loaders))


@dataclass
class PrefixHit:
    """How many leading keys the cluster holds, and the best holder of each."""

    num_keys: int
    holders: list[HolderInfo]


def prefix_of(found: Sequence[list[HolderInfo]], node_id: str | None) -> PrefixHit:
    """The leading run of keys with holders, each with its preferred holder.

    Per-key work runs in C (``list.index``, ``map``): the answer lists of a
    lookup are shared between keys with the same holders, so the preferred
    holder is chosen once per distinct list.
    """
    found = found if isinstance(found, list) else list(found)
    try:
        lead = found[: found.index([])]  # up to the first key nobody holds
    except ValueError:
        lead = found
    distinct = dict(zip(map(id, lead), lead))
    # Every list in ``lead`` names a holder, so ``choose`` finds one for each.
    best_of = {i: h for i, hs in distinct.items() if (h := choose(hs, node_id)) is not None}
    return PrefixHit(len(lead), list(map(best_of.__getitem__, map(id, lead))))


#: The answer for keys nobody holds (shared: answers are read-only).
_NOBODY: list[HolderInfo] = []


def holder_codes(parts: Sequence[tuple[np.ndarray | None, LookupReply]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard replies -> (per key a code, per code its holder list); code 0: nobody.

    ``parts``: (positions of the reply's keys, or None for all keys in order,
    reply). Codes number each shard's holder sets after the previous shards'.
    """
    by_code: list[list[HolderInfo]] = [_NOBODY]
    if len(parts) == 1 and parts[0][0] is None:
        codes = np.frombuffer(parts[0][1].set_ids, dtype="<u4")
    else:
        codes = np.zeros(n, dtype=np.int64)
    for positions, reply in parts:
        ids, sets, holders = np.frombuffer(reply.set_ids, dtype="<u4"), reply.sets, reply.holders
        lut = np.zeros(max(sets, default=0) + 1, dtype=np.int64)
        for i, slots in sets.items():
            lut[i] = len(by_code)
            by_code.append([holders[s] for s in slots])
        if positions is None:
            codes = lut[ids]
        else:
            codes[positions] = lut[ids]
    table_arr = np.empty(len(by_code), dtype=object)
    for i, hs in enumerate(by_code):
        table_arr[i] = hs
    return codes, table_arr


def decode_reply(reply: LookupReply) -> list[list[HolderInfo]]:
    """One shard's lookup reply -> per key its holders (lists shared between
    keys with the same holders: read-only)."""
    codes, by_code = holder_codes([(None, reply)], 0)
    return by_code[codes].tolist()


def prefix_from_codes(codes: np.ndarray, by_code: np.ndarray, node_id: str | None) -> PrefixHit:
    """``prefix_of`` over coded answers: numpy per key, Python per distinct holder set."""
    nobody = np.flatnonzero(codes == 0)
    lead = int(nobody[0]) if len(nobody) else len(codes)
    head = codes[:lead]
    best = np.empty(len(by_code), dtype=object)
    for c in np.flatnonzero(np.bincount(head, minlength=len(by_code))) if lead else ():
        best[c] = choose(by_code[c], node_id)
    return PrefixHit(lead, best[head].tolist())
