"""An engine's ``LookupCache`` over its node's view: reads first from shared memory,
asks for nothing the view answers, reads its own writes, distrusts after a failed
load (no Ray: the view is written here; the client only counts what it was asked)."""

from __future__ import annotations

import os

import pytest

from raykv.core.wire import HolderInfo
from raykv.directory.client import LookupCache, PendingLookup
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.shm_view import ViewReader, ViewWriter, view_path
from raykv.directory.view import NodeView

OS = HolderInfo("os", "object_store", "PLASMA", "a", "ns", node_id="node-a")
FS = HolderInfo("fs", "fs", "SHARED", "f", "ns", node_id=None)


class CountingClient:
    """Stands in for the agent: records what it is asked and never answers."""

    def __init__(self) -> None:
        self.asked: list[bytes] = []

    def lookup_async(self, keys):
        self.asked += list(keys)
        return PendingLookup(list(keys), [])


@pytest.fixture
def setup(tmp_path):
    writer = ViewWriter(view_path("ns", "node-a", str(tmp_path)))
    view = NodeView("node-a", allocate=writer.allocate, changing=writer.changing)
    writer.publish_from(lambda: view.version, view.decode_table)
    view.slot(0, OS)
    client = CountingClient()
    cache = LookupCache(client, ttl_s=0.5, view=ViewReader(writer.path))
    yield view, client, cache
    writer.close()


def _keys(n: int) -> list[bytes]:
    return [os.urandom(44) for _ in range(n)]


def test_what_the_view_knows_needs_no_call(setup):
    view, client, cache = setup
    keys = _keys(32)
    view.register(0, "os", to_blob(fingerprints(keys[:20])))
    assert cache.resolve(keys[:20], 0.0)  # the whole prefix from the view
    assert client.asked == [] and cache.lookups_sent == 0
    assert all(cache.get(k) == [OS] for k in keys[:20])
    for k in keys:  # the step's lookups: 12 keys the view does not know are asked, in one call
        if cache.get(k) is None:
            cache.request(k)
    cache.flush()
    assert sorted(client.asked) == sorted(keys[20:]) and cache.lookups_sent == 1


def test_own_stores_are_read_back_before_the_view_shows_them(setup):
    view, _, cache = setup
    keys = _keys(4)
    view.learn(0, fingerprints(keys), _nobody(len(keys)))  # known: held by nobody
    assert cache.get(keys[0]) == []
    cache.note_stored(keys, FS)
    assert cache.get(keys[0]) == [FS]  # our own store, not in the view yet
    view.register(0, "os", to_blob(fingerprints(keys)))
    assert cache.get(keys[0]) == [OS, FS]


def test_a_failed_load_makes_the_view_distrusted_for_those_keys(setup):
    view, client, cache = setup
    keys = _keys(3)
    view.register(0, "os", to_blob(fingerprints(keys)))
    assert cache.get(keys[0]) == [OS]
    cache.invalidate(keys[:1], "object_store")  # a load from it failed: the view may lag
    assert cache.get(keys[0]) is None  # asked again, not answered from the view
    assert cache.get(keys[1]) == [OS]
    for k in keys:
        if cache.get(k) is None:
            cache.request(k)
    cache.flush()
    assert client.asked == keys[:1]


def test_a_prefix_the_view_leaves_to_ask_for_says_why(setup, tmp_path):
    view, client, cache = setup
    keys = _keys(6)
    view.register(0, "os", to_blob(fingerprints(keys[:2])))
    whys: list[str] = []
    assert cache.resolve(keys[:2], 0.0, unanswered=whys.append) and whys == []  # all answered: nothing said
    cache.resolve(keys[2:3], 0.0, unanswered=whys.append)  # a view of asked keys does not know a new one
    cache.invalidate(keys[:1], "object_store")
    cache.resolve(keys[:1], 0.0, unanswered=whys.append)  # a failed load's key is asked again
    with view.change():  # the agent mid-change for longer than a reader waits
        cache.resolve(keys[3:4], 0.0, unanswered=whys.append)
    assert whys == ["not known", "distrusted", "busy"]
    assert client.asked == [keys[2], keys[0], keys[3]]
    gone = LookupCache(CountingClient(), ttl_s=0.5, view=ViewReader(str(tmp_path / "no-agent")))
    gone.resolve(keys[4:5], 0.0, unanswered=whys.append)  # no agent (yet) on this node
    assert whys[-1] == "no view"


def _nobody(n: int):
    from raykv.core.wire import LookupReply

    return LookupReply(bytes(4 * n), {}, {})
