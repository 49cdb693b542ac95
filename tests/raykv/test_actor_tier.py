"""A directory-backed tier answers HIT and MISS in the step that asked: the
request's whole prefix is resolved in one directory call at its first lookup."""

from __future__ import annotations

import pytest

import raykv
from raykv.tier_driver import TierDriver
from raykv.contract import LookupResult, ReqContext
from raykv.factory import TierFactory
from raykv.identity import scoped_keys
from raykv.keys import prefix_keys
from raykv.primary import PrimaryRegion


@pytest.fixture
def tier_and_services(ray_local):
    # A generous wait: the call returns as soon as the answer lands; the test times nothing.
    services = raykv.start({"namespace": "raykv-no-extra-step", "directory_shards": 2, "lookup_wait_ms": 30_000.0})
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
