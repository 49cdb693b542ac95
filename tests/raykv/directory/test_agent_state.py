"""A node agent's state: feed order, gaps, answers kept only in feed order (no Ray)."""

from __future__ import annotations

import os

from raykv.core.wire import PENDING, HolderInfo
from raykv.directory.agent_state import AgentState, FeedPosition
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.messages import FeedOp, KeyOp, ShardBatch
from raykv.directory.shard import DirectoryShardImpl
from raykv.directory.view import NodeView

LOCAL = HolderInfo("local", "object_store", "PLASMA", "a", "ns", node_id="node-a")
REMOTE = HolderInfo("remote", "object_store", "PLASMA", "b", "ns", node_id="node-b")


def _follow(state: AgentState, shard: DirectoryShardImpl, index: int = 0) -> list[int]:
    pos = state.positions[index]
    return state.apply(index, shard.changes(pos.epoch, pos.seq))


def _fps(n: int):
    return fingerprints([os.urandom(44) for _ in range(n)])


def _setup():
    shard = DirectoryShardImpl(0, 1)
    shard.add_holder(LOCAL)
    shard.add_holder(REMOTE)
    state = AgentState(NodeView("node-a"), 1)
    assert _follow(state, shard) == [0]  # the first page is a gap: read the local holders
    assert [h.holder_id for h in state.holders_to_read(0)] == ["local"]
    return shard, state


def test_an_answer_older_than_the_view_is_not_kept():
    shard, state = _setup()
    fps = _fps(8)
    shard.register("remote", to_blob(fps))
    stale = shard.lookup(to_blob(fps))  # taken before the unregister below
    shard.unregister("remote", to_blob(fps[:4]))
    _follow(state, shard)
    ids = state.answer(0, fps, stale)  # answers the engine that asked...
    assert list(ids != 0) == [True] * 8
    known, _ = state.view.lookup(fps)
    assert not known.any()  # ...but is not kept: the view has applied changes past it


def test_an_answer_ahead_of_the_view_is_kept_and_the_feed_replays_onto_it():
    shard, state = _setup()
    fps = _fps(8)
    shard.register("remote", to_blob(fps))
    shard.unregister("remote", to_blob(fps[:4]))
    fresh = shard.lookup(to_blob(fps))  # the view has not read these two entries yet
    state.answer(0, fps, fresh)
    _follow(state, shard)
    known, ids = state.view.lookup(fps)
    assert known.all() and list(ids != 0) == [False] * 4 + [True] * 4


def test_a_gap_resets_the_view_and_rereads_local_holders():
    shard, state = _setup()
    local, remote = _fps(4), _fps(4)
    shard.register("local", to_blob(local))
    shard.register("remote", to_blob(remote))
    _follow(state, shard)
    state.answer(0, remote, shard.lookup(to_blob(remote)))
    assert state.view.lookup(remote)[0].all() and state.view.lookup(local)[0].all()
    restarted = DirectoryShardImpl(0, 1)  # a new life: sequence numbers start over
    restarted.add_holder(LOCAL)
    restarted.register("local", to_blob(local))
    assert _follow(state, restarted) == [0]
    assert state.gaps == 2 and state.view.resets == 1
    assert not state.view.lookup(remote)[0].any()  # no longer followed: forgotten
    for info in state.holders_to_read(0):
        state.view.register(0, info.holder_id, to_blob(restarted.holder_fingerprints(info.holder_id)))
    known, ids = state.view.lookup(local)
    assert known.all() and (ids != 0).all()


def test_a_shard_that_cannot_be_reached_resets_once():
    shard, state = _setup()
    fps = _fps(4)
    shard.register("remote", to_blob(fps))
    state.answer(0, fps, shard.lookup(to_blob(fps)))
    assert state.lost(0) == [] and state.view.resets == 1
    assert state.lost(0) == [] and state.view.resets == 1  # still down: nothing more to forget
    assert not state.view.lookup(fps)[0].any()


def test_lag_is_measured_per_entry():
    shard, state = _setup()
    shard.register("remote", to_blob(_fps(2)))
    _follow(state, shard)
    p50, p99 = state.lag_percentiles()
    assert p50 is not None and p99 is not None and 0 <= p50 <= p99 < 5


def test_overlapping_pages_apply_each_change_once():
    """A ``changes`` page and an ``apply`` reply's page asked from the same position:
    the later one keeps only what the view has not applied yet."""
    shard, state = _setup()
    fps = _fps(6)
    state.answer(0, fps, shard.lookup(to_blob(fps)))  # asked: held by nobody, and followed from now on
    asked = FeedPosition(state.positions[0].epoch, state.positions[0].seq)
    shard.register("remote", to_blob(fps[:3]))
    early = shard.changes(asked.epoch, asked.seq)  # holds the first register only
    shard.unregister("remote", to_blob(fps[:3]))
    shard.register("remote", to_blob(fps[3:]))
    late = shard.changes(asked.epoch, asked.seq)  # all three entries
    state.apply(0, late, asked)
    assert state.feed_entries == 3
    assert state.apply(0, early, asked) == []  # wholly behind the view: ignored
    assert state.feed_entries == 3 and state.positions[0].seq == late.seq
    known, ids = state.view.lookup(fps)
    assert list(ids != 0) == [False] * 3 + [True] * 3
    # a page asked from an older position that reaches further: only the new entries
    shard.unregister("remote", to_blob(fps[3:]))
    state.apply(0, shard.changes(asked.epoch, asked.seq), asked)
    assert state.feed_entries == 4
    assert not (state.view.lookup(fps)[1] != 0).any()


def test_a_stale_gap_page_does_not_reset_the_view():
    shard, state = _setup()
    fps = _fps(4)
    shard.register("remote", to_blob(fps))
    state.answer(0, fps, shard.lookup(to_blob(fps)))
    gap = shard.changes(0, 0)  # what a call sent before the view followed the shard would bring
    assert gap.gap
    assert state.apply(0, gap, FeedPosition()) == []
    assert state.view.resets == 0 and state.view.lookup(fps)[0].all()


def test_an_apply_reply_carries_the_page_with_its_own_changes():
    shard, state = _setup()
    pos = state.positions[0]
    fps = _fps(4)
    reply = shard.apply(
        ShardBatch((KeyOp(FeedOp.REGISTER, "remote", to_blob(fps)),), to_blob(fps), follow=(pos.epoch, pos.seq))
    )
    assert reply.counts == (4,) and reply.page is not None and reply.lookup is not None
    assert reply.lookup.feed_seq >= reply.page.seq == shard.feed.seq
    state.apply(0, reply.page, FeedPosition(pos.epoch, pos.seq))
    state.answer(0, fps, reply.lookup)
    known, ids = state.view.lookup(fps)
    assert known.all() and (ids != 0).all()
    assert shard.apply(ShardBatch()).page is None  # not asked: no page


def test_the_nodes_own_pending_entries_are_not_its_holdings() -> None:
    """A node's engines' pending entries hold no block: the view does not count them
    among the node's own keys, nor read them as a local holder's."""
    view = NodeView("node-a")
    pending = HolderInfo("pending:node-a:1", "pending", PENDING, "p1", "ns", "node-a")
    assert not view.is_local(pending) and view.is_local(LOCAL)
