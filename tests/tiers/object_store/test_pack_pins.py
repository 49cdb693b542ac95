"""Pins in the object store actor's pack store, without Ray: a pinned pack
survives floods, expires, is capped, is pinned whole and goes with its identity."""

from __future__ import annotations

import pytest

from raykv.core.fields import parse_options
from raykv.core.pins import TENANT_QUOTA, TIER_CAP, PinOutcome, Unpin
from raykv.core.validate import ConfigError
from tests.tiers.object_store.test_pack_store import BLOCK, DictPut, keys, region, settings
from tiers.object_store.pack_store import PackStore, StoreRefused
from tiers.object_store.tier import ObjectStoreOptions


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


OUTCOME: list[PinOutcome] = []


def pack_store(capacity_blocks: int, **kw: object) -> tuple[PackStore, Clock]:
    ps = PackStore(settings(capacity_blocks * BLOCK, **kw), DictPut())
    clock = Clock()
    ps.index.tenants.pins.clock = clock
    return ps, clock


def store(ps: PackStore, ks: list[bytes], ttl: float | None = None, tenant: str = "") -> list[bytes]:
    """One store as the actor runs it: evict, put, take in, pin; the evicted
    keys (the pin's outcome in ``OUTCOME[0]``)."""
    array = region(16)
    plan = ps.plan_store(ks, list(range(len(ks))), len(array), BLOCK, tenant)
    evicted, _ = ps.make_room(plan)
    if not ps.has_room(plan):
        raise ps.no_room(plan)
    ps.add(ps.put_packs(array, plan))
    OUTCOME[:] = [ps.pin([*plan.held, *plan.new_keys], ttl)]
    return evicted


def test_pinned_pack_survives_a_flood_of_three_capacities_and_its_unpinned_twin_does_not():
    ps, _ = pack_store(8)
    pinned, twin = keys("p", 2), keys("u", 2)
    store(ps, pinned, ttl=60)
    store(ps, twin)  # the same age (stored next to it), unpinned
    for i in range(12):  # 24 blocks of unrelated stores: three times the capacity
        store(ps, keys(f"f{i}-", 2))
        assert ps.index.used <= ps.index.capacity
    assert all(k in ps.index for k in pinned)
    assert not any(k in ps.index for k in twin)
    report = ps.report()
    assert report["pinned_blocks"] == 2 and report["pinned_bytes"] == 2 * BLOCK
    assert report["tenant_pinned_bytes"] == {"": 2 * BLOCK}


def test_expiry_frees_the_pack_at_the_next_eviction_pass():
    ps, clock = pack_store(4)
    pinned = keys("p", 2)
    store(ps, pinned, ttl=0.5)
    store(ps, keys("a", 2))
    store(ps, keys("b", 2))  # full: a goes, p is pinned
    assert all(k in ps.index for k in pinned)
    clock.now += 0.6
    assert all(k in ps.index for k in pinned)  # no pass yet: still held, now unpinned
    evicted = store(ps, keys("c", 2))
    assert evicted == pinned  # the oldest by last use


def test_a_later_store_or_pin_with_a_ttl_extends_the_pin():
    ps, clock = pack_store(4)
    pinned = keys("p", 2)
    store(ps, pinned, ttl=1)
    clock.now += 0.9
    store(ps, pinned, ttl=1)  # held: touched and extended to now + 1
    clock.now += 0.9
    store(ps, keys("a", 2))
    store(ps, keys("b", 2))
    assert all(k in ps.index for k in pinned)
    clock.now += 0.2
    assert store(ps, keys("c", 2)) == pinned


def test_pins_are_per_pack_whole():
    ps, _ = pack_store(8)
    ks = keys("k", 4)
    store(ps, ks)  # one pack of 4
    got = ps.pin(ks[1:2], 60)  # one key asked: its whole pack is pinned (an eviction takes it whole)
    assert got.pinned == 4 and len(ps.index.tenants.pins) == 4
    for i in range(8):
        store(ps, keys(f"f{i}-", 2))
    assert all(k in ps.index for k in ks)


def test_tier_cap_refuses_the_pin_counts_it_and_still_stores_the_blocks():
    ps, _ = pack_store(8, max_pinned_fraction=0.25)  # 2 blocks may be pinned
    store(ps, keys("p", 2), ttl=60)
    assert OUTCOME[0].pinned == 2
    over = keys("q", 2)
    store(ps, over, ttl=60)
    assert OUTCOME[0].refused == {TIER_CAP: 2} and OUTCOME[0].pinned == 0
    assert all(k in ps.index for k in over) and not any(k in ps.index.tenants.pins for k in over)


def test_tenant_quota_refuses_the_pin_and_still_stores_the_blocks():
    ps, _ = pack_store(100, tenant_quotas={"t": 8 * BLOCK}, max_pinned_fraction=0.5)  # t may pin 4 blocks
    store(ps, keys("p", 4), ttl=60, tenant="t")
    over = keys("q", 2)
    store(ps, over, ttl=60, tenant="t")
    assert OUTCOME[0].refused == {TENANT_QUOTA: 2}
    assert all(k in ps.index for k in over)
    assert ps.report()["tenant_pinned_bytes"] == {"t": 4 * BLOCK}


def test_store_fails_cleanly_when_only_pinned_blocks_are_left():
    ps, _ = pack_store(4, max_pinned_fraction=1.0)
    pinned = keys("p", 4)
    store(ps, pinned, ttl=60)
    with pytest.raises(StoreRefused) as e:
        store(ps, keys("a", 2))
    assert e.value.counter == "store_no_room" and "pinned" in e.value.why
    assert all(k in ps.index for k in pinned) and ps.index.used == 4 * BLOCK


def test_unpin_by_tenant_keys_and_all_then_lru_applies():
    ps, _ = pack_store(100)
    a, b, c = keys("a", 2), keys("b", 2), keys("c", 2)
    store(ps, a, ttl=60, tenant="ta")
    store(ps, b, ttl=60, tenant="tb")
    store(ps, c, ttl=60, tenant="tc")
    assert ps.index.unpin(Unpin(tenants=("ta",))) == 2
    assert ps.index.unpin(Unpin(keys=(b[0], b[1]))) == 2
    assert ps.report()["tenant_pinned_bytes"] == {"tc": 2 * BLOCK}
    assert ps.index.unpin(Unpin(everything=True)) == 2
    assert ps.report()["pinned_blocks"] == 0
    ps.index.capacity = 4 * BLOCK
    evicted, _ = ps.index.evict_for(2 * BLOCK, "")
    assert evicted == a + b  # plain LRU again


def test_pinned_keys_lasting_are_listed_per_tenant_in_pin_order():
    """What ``pinned_keys`` answers (``raykv warm --all-nodes``): keys pinned for a
    tenant whose pins last at least so long; expired and unpinned ones are not."""
    ps, clock = pack_store(16, max_pinned_fraction=1.0)
    store(ps, keys("a", 2), ttl=100, tenant="t")
    store(ps, keys("plain", 2), tenant="t")  # unpinned
    clock.now += 30
    store(ps, keys("b", 2), ttl=100, tenant="t")
    store(ps, keys("other", 2), ttl=100, tenant="u")
    pins = ps.index.tenants.pins
    assert pins.lasting("t") == [*keys("a", 2), *keys("b", 2)]
    assert pins.lasting("t", 80) == keys("b", 2)  # a's pins have 70 s left
    assert pins.lasting("u", 80) == keys("other", 2) and pins.lasting("nobody") == []
    assert len(pins.lasting(None)) == 6
    store(ps, keys("a", 1), ttl=100, tenant="t")  # extended: lasts again
    assert pins.lasting("t", 80) == [*keys("a", 2), *keys("b", 2)]  # a pack is pinned whole
    clock.now += 101
    assert pins.lasting("t") == [] and pins.lasting(None) == []  # expired


def test_invalidation_removes_pinned_blocks():
    ps, _ = pack_store(100)
    old, new = [b"old:" + k for k in keys("x", 2)], [b"new:" + k for k in keys("x", 2)]
    store(ps, old, ttl=60)
    store(ps, new, ttl=60)
    removed, dropped = ps.remove_prefixed([b"old:"])
    assert removed == old and len(dropped) == 1
    assert ps.report()["pinned_blocks"] == 2 and ps.index.tenants.pins.total == 2 * BLOCK


@pytest.mark.parametrize("bad", [1.5, -0.1, "half", float("nan")])
def test_max_pinned_fraction_is_validated_naming_the_field(bad):
    with pytest.raises(ConfigError) as e:
        parse_options(ObjectStoreOptions, {"max_pinned_fraction": bad}, "secondary_tiers[0]")
    assert e.value.field == "secondary_tiers[0].max_pinned_fraction"
    if isinstance(bad, float) and bad == bad:
        assert "[0, 1]" in str(e.value)


def test_max_pinned_fraction_reaches_the_actor_settings():
    opts = parse_options(ObjectStoreOptions, {"max_pinned_fraction": 0.2}, "t")
    assert opts.actor_settings().max_pinned_fraction == 0.2
    assert ObjectStoreOptions().actor_settings().max_pinned_fraction == 0.5
