"""``PeerSearch``: which other nodes' actors a load asks for its missing blocks.

A load's keys not held by this node's actor may be held by another node's.
The engine hints, per actor, the keys whose lookup chose it (``sources``); the
others are looked up at the directory. The search runs in two rounds:

1. ask each hinted actor for its keys, and the actor ``placement.choose``
   picks among the directory's holders of each unhinted key;
2. for hinted keys the hinted actor no longer had (evicted there since), ask
   the directory again and ask the holders it names, never an actor twice.

``PeerSearch`` holds the plain part: whom to ask for what (``take_todo``),
what they answered (``answered``: ``PackRef``s, items renumbered to the
load's positions) and which keys nobody had. The actor makes the calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from raykv.core import placement
from raykv.core.wire import PLASMA, HolderInfo
from tiers.object_store.messages import TIER_TYPE, PackRef


def is_peer(holder: HolderInfo, tried: set[str]) -> bool:
    """An object store actor (of any node) not asked for this key yet."""
    return holder.tier_type == TIER_TYPE and holder.medium == PLASMA and holder.actor_name not in tried


class PeerSearch:
    """One load's search of other nodes' actors for the keys at ``wanted`` positions."""

    def __init__(self, me: str, node_id: str, keys: Sequence[bytes], wanted: Sequence[int]) -> None:
        self.me = me
        self.node_id = node_id
        self.keys = keys
        self.wanted = list(wanted)
        #: Position -> actor names asked (or never to ask: ``me``).
        self.tried: dict[int, set[str]] = {i: {me} for i in wanted}
        self.hinted: set[int] = set()
        #: Positions some actor answered for, and its packs of them.
        self.got: set[int] = set()
        self.found: list[PackRef] = []
        self._todo: dict[str, list[int]] = {}

    def follow_hints(self, sources: Mapping[str, Sequence[int]]) -> None:
        """Plan to ask each hinted actor (not this one) for its wanted positions;
        a position hinted twice goes to the first actor named."""
        wanted = set(self.wanted)
        for name, positions in sources.items():
            if name == self.me:
                continue
            for p in positions:
                if p in wanted and p not in self.hinted:
                    self._todo.setdefault(name, []).append(p)
                    self.hinted.add(p)

    def unhinted(self) -> list[int]:
        """Wanted positions no hint covered (to look up at the directory)."""
        return [i for i in self.wanted if i not in self.hinted]

    def retry(self) -> list[int]:
        """Hinted positions their actor did not have (round 2)."""
        return [i for i in self.wanted if i in self.hinted and i not in self.got]

    def route(self, positions: Sequence[int], holders: Sequence[Sequence[HolderInfo]]) -> None:
        """Plan to ask, for each of ``positions``, the peer ``placement.choose``
        picks among its directory holders (``holders``, in order) not asked yet."""
        for pos, hs in zip(positions, holders):
            tried = self.tried[pos]
            peer = placement.choose(list(hs), self.node_id, lambda h: is_peer(h, tried))
            if peer is not None:
                self._todo.setdefault(peer.actor_name, []).append(pos)

    def take_todo(self) -> dict[str, list[int]]:
        """What to ask now: actor name -> positions (marked as asked)."""
        todo, self._todo = self._todo, {}
        for name, positions in todo.items():
            for p in positions:
                self.tried[p].add(name)
        return todo

    def keys_at(self, positions: Sequence[int]) -> list[bytes]:
        return [self.keys[p] for p in positions]

    def answered(self, positions: Sequence[int], refs: Sequence[PackRef]) -> None:
        """Take an actor's ``get_refs`` answer for the keys at ``positions``."""
        for ref in refs:
            items = [(positions[q], idx) for q, idx in ref.items]
            self.got.update(p for p, _ in items)
            self.found.append(ref._replace(items=items))

    def missing(self) -> list[int]:
        """Wanted positions no actor answered for."""
        return [i for i in self.wanted if i not in self.got]
