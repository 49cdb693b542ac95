"""A directory-backed tier answers HIT and MISS in the step that asked: the
request's whole prefix is resolved in one directory call at its first lookup."""

from __future__ import annotations

import pytest
import ray

import raykv
from raykv.core.contract import LookupResult, ReqContext
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.waiting import wait_until


@pytest.fixture
def tier_and_services(ray_local):
    # A generous wait: the call returns as soon as the answer lands; the test times nothing.
    # Views of asked keys only: a key the node's view does not know is a directory call.
    services = raykv.start(
        {
            "namespace": "raykv-no-extra-step",
            "directory_shards": 2,
            "lookup_wait_ms": 1000.0,
            "agent_view_all_keys": False,
        }
    )
    region = PrimaryRegion(16, 4096)
    tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
    yield tier, services
    tier.shutdown()
    region.close()
    services.shutdown()


def test_first_lookup_resolves_the_whole_prefix_in_one_call(tier_and_services):
    tier, services = tier_and_services
    keys = prefix_keys(list(range(12 * 16)), 16)  # 12 keys
    assert TierDriver(tier).store(keys[:8], list(range(8))).success
    cache = services.lookup_cache
    for k in keys:
        cache.invalidate(scoped_keys([k]))  # forget what our own store taught the cache
    sent = cache.lookups_sent
    ctx = ReqContext("r1", prefix_keys=lambda: keys)
    answers = [tier.lookup(k, ctx) for k in keys]  # one scheduler step's scan
    assert answers == [LookupResult.HIT] * 8 + [LookupResult.MISS] * 4
    assert cache.lookups_sent - sent == 1, "the prefix took more than one directory call"


def test_a_miss_is_answered_in_the_step_that_asked(tier_and_services):
    tier, services = tier_and_services
    fresh = prefix_keys(list(range(5000, 5000 + 4 * 16)), 16)
    ctx = ReqContext("r2")  # no prefix known: the first key alone is resolved at once
    assert tier.lookup(fresh[0], ctx) is LookupResult.MISS
    assert tier.lookup(fresh[1], ctx) is LookupResult.RETRY  # later keys: batched, answered next step


def test_without_a_wait_the_prefix_still_goes_in_one_call(ray_local):
    """lookup_wait_ms=0: nothing waits, but the request's first lookup sends its
    whole prefix, so the next step knows every key (one RETRY round, not one per key)."""
    services = raykv.start({"namespace": "raykv-no-wait", "directory_shards": 2, "lookup_wait_ms": 0.0})
    try:
        with PrimaryRegion(16, 4096) as region:
            tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
            try:
                keys = prefix_keys(list(range(9000, 9000 + 6 * 16)), 16)
                assert TierDriver(tier).store(keys[:3], [0, 1, 2]).success
                cache = services.lookup_cache
                cache.invalidate(scoped_keys(keys))
                sent = cache.lookups_sent
                ctx = ReqContext("r3", prefix_keys=lambda: keys)
                assert tier.lookup(keys[0], ctx) is LookupResult.RETRY
                assert cache.lookups_sent - sent == 1
                cache.wait(10)  # the next step: the one call has answered
                assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
                assert cache.lookups_sent - sent == 1, "later keys of the prefix were asked again"
            finally:
                tier.shutdown()
    finally:
        services.shutdown()


def test_a_complete_view_answers_a_new_prefix_in_its_first_step_without_a_call(ray_local):
    """The default view (every key of the directory): once complete, a prefix nobody
    holds is a MISS for every key in the step that asked, and no call is made."""
    services = raykv.start({"namespace": "raykv-complete-view", "directory_shards": 2, "lookup_wait_ms": 0.0})
    try:
        agent = services.directory_agent()
        wait_until(lambda: ray.get(agent.ready.remote()), timeout_s=30, what="the node's view to be complete")
        with PrimaryRegion(16, 4096) as region:
            tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
            try:
                keys = prefix_keys(list(range(12_000, 12_000 + 8 * 16)), 16)
                assert TierDriver(tier).store(keys[:3], [0, 1, 2]).success
                cache = services.lookup_cache
                wait_until(
                    lambda: cache.view is not None and cache.view.lookup(scoped_keys(keys[:3]))[0],
                    timeout_s=10,
                    what="the stored keys in the node's view",
                )
                sent = cache.lookups_sent
                ctx = ReqContext("r4", prefix_keys=lambda: keys)
                assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 5
                assert cache.lookups_sent == sent, "a complete view still asked the directory"
            finally:
                tier.shutdown()
    finally:
        services.shutdown()


def test_wait_budget_follows_the_directory_round_trip(tier_and_services):
    """Waiting pays only while round trips fit in the wait; a slow directory is
    probed once a second, so a recovered one is waited for again."""
    _, services = tier_and_services
    cache = services.lookup_cache.round_trips
    cache.rtt_s = None
    assert cache.wait_budget(0.005) == 0.005  # nothing known yet: wait
    assert cache.wait_budget(0.0) == 0.0
    cache.rtt_s = 0.050  # round trips slower than the budget
    assert cache.wait_budget(0.005) == 0.005  # the probe
    assert cache.wait_budget(0.005) == 0.0  # then no waiting until the next probe
    cache.rtt_s = 0.001
    assert cache.wait_budget(0.005) == 0.005
