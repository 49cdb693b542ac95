"""Placement: the one rule for which holder a load reads, and which tier of an engine loads it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raykv.core.placement import (
    PLASMA,
    SHARED,
    HolderInfo,
    LoadPlanner,
    LookupReply,
    choose,
    holder_codes,
    prefix_from_codes,
    prefix_of,
)

HERE, THERE = "node-here", "node-there"
LOCAL = HolderInfo("object_store:here", "object_store", PLASMA, "os-here", "ns", HERE)
REMOTE = HolderInfo("object_store:there", "object_store", PLASMA, "os-there", "ns", THERE)
ROOT_A = HolderInfo("fs:a", "fs", SHARED, "fs-a", "ns")
ROOT_B = HolderInfo("fs:b", "fs", SHARED, "fs-b", "ns")


@dataclass
class ObjectStoreLoader:
    """What an object store tier can read: any node's plasma, while its actor lives."""

    alive: bool = True

    def can_load(self, h: HolderInfo) -> bool:
        return self.alive and h.medium == PLASMA


@dataclass
class FsLoader:
    holder_id: str

    def can_load(self, h: HolderInfo) -> bool:
        return h.holder_id == self.holder_id


def test_choose_prefers_this_node_then_shared_then_other_nodes() -> None:
    assert choose([REMOTE, ROOT_A, LOCAL], HERE) == LOCAL
    assert choose([REMOTE, ROOT_A], HERE) == ROOT_A
    assert choose([REMOTE], HERE) == REMOTE
    assert choose([], HERE) is None
    # seen from the other node, its own plasma comes first
    assert choose([LOCAL, ROOT_A, REMOTE], THERE) == REMOTE


def test_choose_only_picks_usable_holders() -> None:
    assert choose([LOCAL, ROOT_A], HERE, lambda h: h.medium == SHARED) == ROOT_A
    assert choose([LOCAL], HERE, lambda h: False) is None


def test_planner_loads_from_another_node_when_the_shared_holder_is_out_of_reach() -> None:
    """An engine without an fs tier of root A must not miss a block held by
    another node's plasma just because root A holds it too."""
    planner = LoadPlanner(HERE)
    tag = b"T" * 8
    planner.add(tag, ObjectStoreLoader())
    assert planner.source(tag, [REMOTE, ROOT_A]) == REMOTE
    # with a tier of root A, shared storage comes before the other node
    planner.add(tag, FsLoader("fs:a"))
    assert planner.source(tag, [REMOTE, ROOT_A]) == ROOT_A
    # another root it cannot read changes nothing
    assert planner.source(tag, [REMOTE, ROOT_B]) == REMOTE


def test_planner_is_per_identity_and_follows_liveness() -> None:
    planner = LoadPlanner(HERE)
    os_tier = ObjectStoreLoader()
    planner.add(b"A" * 8, os_tier)
    assert planner.source(b"B" * 8, [LOCAL]) is None  # no tier of that identity here
    assert planner.source(b"A" * 8, [LOCAL, ROOT_A]) == LOCAL
    os_tier.alive = False  # the node actor died: nothing plasma is readable
    assert planner.source(b"A" * 8, [LOCAL, REMOTE]) is None
    planner.remove(b"A" * 8, os_tier)
    os_tier.alive = True
    assert planner.source(b"A" * 8, [LOCAL]) is None


def _reply(per_key: list[list[HolderInfo]]) -> LookupReply:
    """A shard's lookup reply for these answers (set id 0: nobody)."""
    holders = {h.holder_id: h for hs in per_key for h in hs}
    slots = {hid: i for i, hid in enumerate(holders)}
    sets: dict[tuple[int, ...], int] = {}
    ids = [sets.setdefault(tuple(sorted(slots[h.holder_id] for h in hs)), len(sets) + 1) if hs else 0 for hs in per_key]
    table = {slots[hid]: h for hid, h in holders.items()}
    return LookupReply(np.asarray(ids, dtype="<u4").tobytes(), {v: k for k, v in sets.items()}, table)


def test_prefix_of_decoded_and_coded_answers_agree() -> None:
    answers = [[LOCAL, ROOT_A], [ROOT_A, REMOTE], [REMOTE], [], [LOCAL]]
    hit = prefix_of(answers, HERE)
    assert hit.num_keys == 3 and hit.holders == [LOCAL, ROOT_A, REMOTE]
    codes, by_code = holder_codes([(None, _reply(answers))], len(answers))
    assert [sorted(h.holder_id for h in hs) for hs in by_code[codes]] == [
        sorted(h.holder_id for h in hs) for hs in answers
    ]
    coded = prefix_from_codes(codes, by_code, HERE)
    assert (coded.num_keys, coded.holders) == (hit.num_keys, hit.holders)
