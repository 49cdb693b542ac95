"""Which other nodes' actors a load asks for its missing blocks, and what it
makes of their answers (``PeerSearch``, without Ray)."""

from __future__ import annotations

from raykv.core.wire import PLASMA, SHARED, HolderInfo
from tiers.object_store.messages import PackRef, holder_info
from tiers.object_store.peers import PeerSearch

NS = "ns"
ME = holder_info("node-a", NS)
B = holder_info("node-b", NS)
C = holder_info("node-c", NS)
FS = HolderInfo("fs:x", "fs", SHARED, "raykv-fs-x", NS)
OTHER_PLASMA = HolderInfo("example_node:node-b", "example_node", PLASMA, "raykv-example-b", NS, "node-b")

KEYS = [b"k0", b"k1", b"k2", b"k3", b"k4"]


def search(wanted: list[int]) -> PeerSearch:
    return PeerSearch(ME.actor_name, "node-a", KEYS, wanted)


def test_hints_go_to_the_hinted_actor_once_and_never_to_ourselves():
    s = search([0, 1, 2, 4])
    s.follow_hints({ME.actor_name: [0], B.actor_name: [1, 3, 2], C.actor_name: [2, 4]})
    # 0 hinted at ourselves: not hinted; 3 not wanted; 2 goes to B (named first)
    assert s.unhinted() == [0]
    todo = s.take_todo()
    assert todo == {B.actor_name: [1, 2], C.actor_name: [4]}
    assert s.tried[1] == {ME.actor_name, B.actor_name} and s.tried[0] == {ME.actor_name}
    assert s.take_todo() == {}  # asked once


def test_route_picks_an_object_store_peer_not_asked_yet():
    s = search([0, 1, 2, 3])
    s.route(
        [0, 1, 2, 3],
        [
            [ME, FS, B],  # not us, not the fs tier: B
            [OTHER_PLASMA],  # another tier's plasma: nobody
            [],  # nobody holds it
            [C, B],  # equal preference: the first
        ],
    )
    todo = s.take_todo()
    assert todo == {B.actor_name: [0], C.actor_name: [3]}
    s.route([0, 3], [[B, C], [C]])  # round 2: B was asked for 0, C for 3
    assert s.take_todo() == {C.actor_name: [0]}


def test_answers_are_renumbered_to_the_loads_positions_and_the_rest_retried():
    s = search([1, 2, 4])
    s.follow_hints({B.actor_name: [1, 2, 4]})
    todo = s.take_todo()
    assert s.keys_at(todo[B.actor_name]) == [b"k1", b"k2", b"k4"]
    # B still had k1 and k4 (positions 0 and 2 of what it was asked), in two packs
    s.answered(todo[B.actor_name], [PackRef("p0", [10], 5, [(2, 1)]), PackRef("p1", [5], 5, [(0, 0)])])
    assert s.got == {1, 4}
    assert [(r.ref, r.items) for r in s.found] == [("p0", [(4, 1)]), ("p1", [(1, 0)])]
    assert s.retry() == [2]  # B evicted k2: ask the directory again
    s.route([2], [[B, C]])
    assert s.take_todo() == {C.actor_name: [2]}
    s.answered([2], [])  # C did not have it either
    assert s.missing() == [2]


def test_unhinted_keys_are_not_retried():
    s = search([0])
    s.route([0], [[B]])
    s.answered(s.take_todo()[B.actor_name], [])
    assert s.retry() == [] and s.missing() == [0]
