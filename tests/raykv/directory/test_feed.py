"""The shards' change feed: ordered pages, bounded tail, gaps (no Ray)."""

from __future__ import annotations

from raykv.core.wire import HolderInfo
from raykv.directory.feed import ChangeFeed
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.messages import FeedOp
from raykv.directory.shard import DirectoryShardImpl

HOLDER = HolderInfo("h1", "object_store", "PLASMA", "a1", "ns", node_id="n1")


def test_pages_follow_in_order_and_resume():
    feed = ChangeFeed()
    first = feed.page(0, 0, [HOLDER])
    assert first.gap and first.holders == (HOLDER,) and first.seq == 0
    for i in range(3):
        feed.append(FeedOp.REGISTER, "h1", to_blob(fingerprints([bytes([i]) * 40])))
    page = feed.page(first.epoch, first.seq, [])
    assert not page.gap
    assert [e.seq for e in page.entries] == [1, 2, 3] and page.seq == 3
    assert all(e.at > 0 for e in page.entries)
    assert feed.page(first.epoch, 2, []).entries == page.entries[2:]
    assert feed.page(first.epoch, 3, []).entries == ()


def test_a_reader_of_another_life_or_too_far_behind_gets_a_gap():
    feed = ChangeFeed(max_keys=10)
    for i in range(5):
        feed.append(FeedOp.REGISTER, "h1", to_blob(fingerprints([bytes([i, j]) * 20 for j in range(4)])))
    assert feed.first_seq > 1  # 20 keys do not fit in 10: the oldest entries went
    assert feed.page(feed.epoch, 0, []).gap
    assert feed.page(feed.epoch ^ 1, feed.seq, []).gap  # an earlier life of the shard
    assert feed.page(feed.epoch, feed.seq + 5, []).gap  # ahead of it: cannot be
    assert not feed.page(feed.epoch, feed.first_seq - 1, []).gap


def test_the_feed_keeps_only_its_last_minute():
    """A steadily churning shard keeps a bounded tail by age, not every change up to
    its key cap (the hour-long memory soak's shards grew 90 MiB/h before)."""
    now = [1000.0]
    feed = ChangeFeed(max_age_s=60.0, clock=lambda: now[0])
    for i in range(600):  # ten minutes of one change a second
        now[0] += 1.0
        feed.append(FeedOp.REGISTER, "h1", to_blob(fingerprints([bytes([i % 256, i // 256]) * 20])))
    assert feed.seq == 600 and 60 <= feed.seq - feed.first_seq + 1 <= 61
    assert feed.page(feed.epoch, feed.seq - 30, []).entries  # a reader 30 s behind follows
    assert feed.page(feed.epoch, feed.seq - 300, []).gap  # one 5 minutes behind starts over


def test_a_shard_feeds_every_change_it_makes():
    shard = DirectoryShardImpl(0, 1)
    shard.add_holder(HOLDER)
    keys = [bytes([i]) * 44 for i in range(6)]
    fps = fingerprints(keys)
    assert shard.register("h1", to_blob(fps)) == 6
    assert shard.register("h1", to_blob(fps[:3])) == 0  # nothing new: nothing fed
    assert shard.unregister("h1", to_blob(fps[:2])) == 2
    shard.drop_holder("h1", "dead")
    page = shard.changes(shard.feed.epoch, 0)
    ops = [(e.op, e.holder_id, len(e.fps) // 8) for e in page.entries]
    assert ops == [
        (FeedOp.ADD_HOLDER, "h1", 0),
        (FeedOp.REGISTER, "h1", 6),
        (FeedOp.UNREGISTER, "h1", 2),
        (FeedOp.DROP_HOLDER, "h1", 0),
    ]
    assert page.entries[0].info == HOLDER
    reply = shard.lookup(to_blob(fps))
    assert (reply.feed_epoch, reply.feed_seq) == (shard.feed.epoch, shard.feed.seq)
