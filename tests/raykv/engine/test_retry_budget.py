"""A request is held back by RETRY answers at most ``lookup_retry_budget_ms``;
past it, its still-unknown keys answer MISS (it computes them), counted
(issue 21, item 3). And the engine-side step meter counts what a step costs."""

from __future__ import annotations

import time

import pytest

import raykv
from raykv.config.options import RaykvConfig
from raykv.core.contract import LookupResult, ReqContext
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import prefix_keys
from raykv.core.validate import ConfigError
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver, driver_step_cost
from raykv.metrics.step_cost import StepCost


def _tier(namespace: str, **config):
    # Views of asked keys only: a key the view does not know is a question for the
    # directory, whose answer a request waits for (a complete view, the default, knows every key).
    config = {"agent_view_all_keys": False, **config}
    services = raykv.start({"namespace": namespace, "directory_shards": 2, **config})
    region = PrimaryRegion(16, 4096)
    tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
    return services, region, tier


def _close(services, region, tier) -> None:
    tier.shutdown()
    region.close()
    services.shutdown()


def test_the_budget_is_validated_and_defaults_to_50_ms() -> None:
    assert RaykvConfig().lookup_retry_budget_ms == 50.0
    assert RaykvConfig.from_dict({"lookup_retry_budget_ms": 0}).lookup_retry_budget_ms == 0.0
    for bad in (-1, float("nan"), "50ms", True, 1e9):
        with pytest.raises(ConfigError, match="lookup_retry_budget_ms"):
            RaykvConfig.from_dict({"lookup_retry_budget_ms": bad})


def test_a_budget_of_zero_never_answers_retry(ray_local) -> None:
    """lookup_retry_budget_ms=0 (and no lookup wait): an unknown key answers MISS
    at once, counted as a budget miss; its directory answer still comes for later requests."""
    services, region, tier = _tier("raykv-budget-zero", lookup_retry_budget_ms=0.0, lookup_wait_ms=0.0)
    try:
        keys = prefix_keys(list(range(6 * 16)), 16)
        assert TierDriver(tier).store(keys[:3], [0, 1, 2]).success  # the driver itself is exempt
        cache = services.lookup_cache
        cache.invalidate(scoped_keys(keys))
        ctx = ReqContext("r0")
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 6
        assert ctx.retries == 0
        tier.on_schedule_end()
        assert tier.metrics.totals.get("raykv_lookup_retries", 0) == 0
        assert tier.metrics.totals["raykv_lookup_retry_budget_misses"] == 6
        cache.wait(10)  # the answers land: a later request finds its hits
        later = ReqContext("r1")
        assert [tier.lookup(k, later) for k in keys] == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
    finally:
        _close(services, region, tier)


def test_a_request_held_back_past_its_budget_computes(ray_local) -> None:
    """Budget 30 ms: a request whose key stays unknown over consecutive lookup
    rounds gets RETRY, then, once 30 ms have passed, MISS; another request has
    its own budget, and a round without RETRY gives a request its budget back."""
    services, region, tier = _tier("raykv-budget-30", lookup_retry_budget_ms=30.0, lookup_wait_ms=0.0)
    try:
        keys = prefix_keys(list(range(10_000, 10_000 + 4 * 16)), 16)
        cache = services.lookup_cache
        key, fresh = keys[1], keys[2]

        def unanswered(k: bytes) -> None:  # the directory's answer is not back: as if it were slow
            cache.wait(10)
            cache.invalidate(scoped_keys([k]))

        held = ReqContext("held")
        assert tier.lookup(key, held) is LookupResult.RETRY  # step 1: asked at its end
        tier.on_schedule_end()
        time.sleep(0.04)  # not a wait: 40 ms pass, more than the 30 ms budget under test
        unanswered(key)
        assert tier.lookup(key, held) is LookupResult.MISS  # step 2: held 40 ms > 30 ms
        assert held.retries == 1
        other = ReqContext("other")
        assert tier.lookup(key, other) is LookupResult.RETRY  # its own budget
        tier.on_schedule_end()
        assert tier.metrics.totals["raykv_lookup_retry_budget_misses"] == 1

        # A round in which the request got its answers ends its hold.
        back = ReqContext("back")
        assert tier.lookup(fresh, back) is LookupResult.RETRY
        tier.on_schedule_end()
        cache.wait(10)
        assert tier.lookup(fresh, back) is LookupResult.MISS  # answered: nobody holds it
        tier.on_schedule_end()
        time.sleep(0.04)  # not a wait: 40 ms pass, more than the 30 ms budget under test
        cache.invalidate(scoped_keys([fresh]))  # e.g. its answer expired while it queued
        assert tier.lookup(fresh, back) is LookupResult.RETRY  # a new hold, a new budget
        assert back.retries == 2
    finally:
        _close(services, region, tier)


def test_the_step_meter_counts_a_drivers_steps_polls_and_requests(raykv_services) -> None:
    cost = driver_step_cost()
    before = cost.snapshot()
    with PrimaryRegion(16, 4096) as region:
        tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=raykv_services)
        try:
            drv = TierDriver(tier)
            keys = prefix_keys(list(range(20_000, 20_000 + 8 * 16)), 16)
            assert drv.store(keys[:4], [0, 1, 2, 3]).success
            assert drv.lookup(keys) == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 4
            assert drv.load(keys[:2], [8, 9]).success
        finally:
            tier.shutdown()
    after = cost.snapshot()
    assert after["steps"] > before["steps"]
    assert after["tier_seconds"] > before["tier_seconds"]
    assert after["polls"] > before["polls"]  # the jobs' ray.wait polls at least
    assert after["requests"] == before["requests"] + 1  # one lookup call, one request
    assert 0 < after["step_seconds_p50"] <= after["step_seconds_p99"] < 5.0


def test_a_step_is_what_was_added_since_the_last() -> None:
    cost = StepCost(node="n")
    cost.ns += 1_000
    cost.ns += 2_000
    cost.step_end()
    cost.ns += 500
    cost.step_end()
    snap = cost.snapshot()
    assert snap["steps"] == 2 and snap["step_seconds_p99"] >= 3e-6
    assert snap["tier_seconds"] >= 3.5e-6
    ctx = ReqContext("r")
    ctx.retries = 3
    cost.request_finished(ctx)
    cost.request_finished(ctx)  # reported by a second tier: counted once
    assert cost.snapshot()["retries"] == 3 and cost.snapshot()["requests"] == 1
    deltas, steps, retries = cost.take()
    assert deltas["steps"] == 2 and len(steps) == 2 and retries == [3]
    assert cost.take()[0]["steps"] == 0
