"""The engine reads holder actors' typed answers (``raykv.core.wire``): a store's
``StoreAnswer``, a load's ``LoadAnswer`` key by key, ``ready()``'s ``HolderReady``
and ``events_since``'s ``HoldingsPage``; anything else fails the job or the start."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import ray

from raykv.core.contract import ReqContext, TransferJob
from raykv.core.errors import RaykvError
from raykv.core.jobs import JobTracker
from raykv.core.outcomes import CallOutcome, wait_all
from raykv.core.wire import HolderInfo, HolderReady, HoldingsPage, LoadAnswer, StoreAnswer
from raykv.engine.actor_tier import ActorCallTier, DirectoryBackedTier, _InFlight
from raykv.engine.polling import HoldingsFeed

HOLDER = HolderInfo("h1", "object_store", "plasma", "actor-h1", "ns", node_id="n1")
TAG = b"T" * 8


class _Cache:
    def __init__(self) -> None:
        self.stored: list[tuple[list[bytes], HolderInfo]] = []
        self.invalidated: list[bytes] = []

    def note_stored(self, keys: list[bytes], holder: HolderInfo) -> None:
        self.stored.append((keys, holder))

    def invalidate(self, keys: list[bytes], tier_type: str) -> None:
        self.invalidated += keys


class _Tier(ActorCallTier):
    """No data path: only the answers are read."""

    can_load = submit_store = submit_load = None


def _tier() -> ActorCallTier:
    """An ``ActorCallTier`` with just what ``finish_job`` and ``_finish`` use (no services)."""
    tier = _Tier.__new__(_Tier)
    tier.tier_type = "object_store"
    tier.node_id = "n1"
    tier.jobs = JobTracker()
    tier._cache = _Cache()
    tier.holder_info = HOLDER
    return tier


def _job(job_id: int, keys: list[bytes], load: bool) -> TransferJob:
    return TransferJob(job_id, keys, np.arange(len(keys)), load, ReqContext("r"))


def test_a_store_answer_stores_or_fails() -> None:
    tier = _tier()
    keys = [TAG + b"k1xxx", TAG + b"k2xxx"]
    ok, bad = _job(1, [b"k1xxx", b"k2xxx"], False), _job(2, [b"k3xxx"], False)
    for job in (ok, bad):
        tier.jobs.begin(job)
    tier.finish_job("store", ok, keys, StoreAnswer(bytes=8192))
    tier.finish_job("store", bad, keys[:1], StoreAnswer(error="object store is full"))
    first, second = tier.jobs.take()
    assert first.success and first.transfer_bytes == 8192
    assert tier._cache.stored == [(keys, HOLDER)]
    assert not second.success and second.error == "object_store store failed: object store is full"


def test_a_load_answer_fails_key_by_key() -> None:
    tier = _tier()
    own = [b"k1xxx", b"k2xxx", b"k3xxx"]
    keys = [TAG + k for k in own]
    whole, partial = _job(1, own, True), _job(2, own, True)
    for job in (whole, partial):
        tier.jobs.begin(job)
    tier.finish_job("load", whole, keys, LoadAnswer(ok=(0, 1, 2), bytes=3 * 4096))
    tier.finish_job("load", partial, keys, LoadAnswer(ok=(0, 2), errors={1: "not held"}, bytes=2 * 4096))
    first, second = tier.jobs.take()
    assert first.success and first.transfer_bytes == 3 * 4096
    assert not second.success and list(second.successful_keys or ()) == [own[0], own[2]]
    assert second.error is not None and "1 of 3 keys not loaded" in second.error and "not held" in second.error
    assert tier._cache.invalidated == [keys[1]]  # its next lookup asks the directory again


@pytest.mark.parametrize("kind", ["store", "load"])
def test_an_answer_of_another_type_fails_the_job(ray_local, kind: str) -> None:
    tier = _tier()
    keys = [TAG + b"k1xxx"]
    job = _job(1, [b"k1xxx"], kind == "load")
    tier.jobs.begin(job)
    wrong = {"bytes": 4096} if kind == "store" else StoreAnswer(bytes=4096)  # an old dict; the other kind
    outcome = CallOutcome(ray.put(wrong))
    assert wait_all([outcome], 30)
    tier._finish(_InFlight(kind, job, keys, 0.0, outcome))
    (result,) = tier.jobs.take()
    assert not result.success and f"{kind} failed: the actor answered a {type(wrong).__name__}" in (result.error or "")
    assert tier._cache.stored == []


def _ready_actor(answer: object) -> SimpleNamespace:
    return SimpleNamespace(ready=SimpleNamespace(remote=lambda: ray.put(answer)))


def test_start_holder_actor_returns_holder_ready(ray_local, caplog) -> None:
    ready = HolderReady(HOLDER, capacity_bytes=1 << 20, requested_capacity_bytes=1 << 20, details={"node": "n1"})
    assert DirectoryBackedTier.start_holder_actor(_ready_actor(ready), "the actor", 1 << 20, 10) == ready
    with caplog.at_level(logging.WARNING, logger="raykv.engine.actor_tier"):
        assert DirectoryBackedTier.start_holder_actor(_ready_actor(ready), "the actor", 2 << 20, 10) == ready
    assert "the actor already runs with other settings: capacity_bytes 1.0 MiB (asked 2.0 MiB)" in caplog.text
    with pytest.raises(RaykvError, match="answered ready\\(\\) with a dict, not a HolderReady"):
        DirectoryBackedTier.start_holder_actor(_ready_actor({"requested_capacity_bytes": 1}), "the actor", 1, 10)


def _feed(pages: list[object]) -> HoldingsFeed:
    calls = iter(pages)
    actor = SimpleNamespace(events_since=SimpleNamespace(remote=lambda since, tag: ray.put(next(calls))))
    return HoldingsFeed(actor, TAG)


def _settle(feed: HoldingsFeed) -> None:
    if feed._call is not None:
        assert wait_all([feed._call], 30)
    feed.poll()


def test_the_holdings_feed_reads_pages(ray_local) -> None:
    pages: list[object] = [
        HoldingsPage(next=3, snapshot=[TAG + b"a", TAG + b"b"], events=[]),
        HoldingsPage(next=5, snapshot=None, events=[(False, [TAG + b"c"]), (True, [TAG + b"a"])]),
        {"next": 9, "snapshot": None, "events": []},  # not a page: start over
        HoldingsPage(next=10, snapshot=[TAG + b"b"], events=[]),
    ]
    feed = _feed(pages)
    feed.poll()  # asks for a snapshot
    _settle(feed)
    assert feed._since == 3
    _settle(feed)
    assert feed._since == 5
    _settle(feed)
    assert feed._since is None  # the odd answer: the next read is a snapshot
    _settle(feed)  # asks again
    _settle(feed)
    events = feed.take()
    assert [(e.keys, e.removed) for e in events] == [
        ([b"a", b"b"], False),
        ([b"c"], False),
        ([b"a"], True),
        ([b"b"], False),
    ]
