"""Pins in ``TenantLRU`` (``raykv.core.pins``): victims skip them until they
expire, later TTLs extend them, caps refuse them, unpin drops them; and the
request field ``cache_ttl_s`` never fails a request (bad values are ignored)."""

from __future__ import annotations

import math

import pytest

from raykv.core.contract import ReqContext
from raykv.core.pins import (
    MAX_CACHE_TTL_S,
    TENANT_QUOTA,
    TIER_CAP,
    PinBatch,
    Unpin,
    cache_ttl_of,
    pin_keys,
)
from raykv.core.tenants import TenantLRU
from raykv.core.validate import request_ttl_value


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lru_with(keys: list[bytes], tenant: str = "", nbytes: int = 10, **kw: object) -> tuple[TenantLRU, Clock]:
    clock = Clock()
    lru = TenantLRU(clock=clock, **kw)  # type: ignore[arg-type]
    for k in keys:
        lru.add(k, tenant, nbytes)
    return lru, clock


def test_victims_skip_pinned_keys_and_an_unpinned_key_of_the_same_age_goes():
    lru, _ = lru_with([b"p", b"u", b"x"])
    assert lru.pin(pin_keys([b"p"]), 60, capacity=100).pinned == 1
    victims = []
    while (v := lru.shared_victim(None)) is not None:
        victims.append(v)
        lru.discard(v)
    assert victims == [b"u", b"x"]  # p, the oldest, is never a victim
    assert b"p" in lru and lru.oldest() is None
    assert lru.pins.used("") == 10 and lru.used("") == 10


def test_expired_pin_ages_from_its_last_use_and_goes_at_the_next_pass():
    lru, clock = lru_with([b"p", b"a"])
    lru.pin(pin_keys([b"p"]), 0.5, capacity=100)
    lru.add(b"b", "", 10)
    assert lru.shared_victim(None) == b"a"
    clock.now += 0.49
    assert lru.shared_victim(None) == b"a"  # still pinned
    clock.now += 0.02
    assert lru.shared_victim(None) == b"p"  # expired: the oldest again (its last use was first)
    assert len(lru.pins) == 0 and lru.pin_report()["pinned_bytes"] == 0


def test_touch_while_pinned_counts_as_a_use_after_expiry():
    lru, clock = lru_with([b"p", b"a", b"b"])
    lru.pin(pin_keys([b"p"]), 1, capacity=100)
    lru.touch([b"p"])  # used after a and b
    clock.now += 2
    assert lru.shared_victim(None) == b"a"
    lru.discard(b"a")
    assert lru.shared_victim(None) == b"b"


def test_a_later_ttl_extends_and_an_earlier_one_does_not_shorten():
    lru, clock = lru_with([b"p", b"a"])
    lru.pin(pin_keys([b"p"]), 10, capacity=100)
    clock.now += 5
    lru.pin(pin_keys([b"p"]), 20, capacity=100)  # until now + 20 = start + 25
    lru.pin(pin_keys([b"p"]), 1, capacity=100)  # shorter: changes nothing
    clock.now += 19
    assert lru.shared_victim(None) == b"a"
    assert lru.pin_report()["pin_expiries"] == [{"tenant": "", "seconds_left": 1.0, "blocks": 1, "bytes": 10}]
    clock.now += 1.01
    assert lru.shared_victim(None) == b"p"


def test_tier_cap_refuses_and_the_key_stays_unpinned():
    lru, _ = lru_with([b"a", b"b", b"c"], max_pinned_fraction=0.5)
    got = lru.pin(pin_keys([b"a", b"b", b"c"]), 60, capacity=50)  # cap 25 bytes: two keys
    assert got.pinned == 2 and got.refused == {TIER_CAP: 1}
    assert b"c" in lru and b"c" not in lru.pins
    assert lru.shared_victim(None) == b"c"
    # the refused group of a pack is refused whole
    lru2, _ = lru_with([b"a", b"b", b"c"], max_pinned_fraction=0.5)
    got = lru2.pin([[b"a"], [b"b", b"c"]], 60, capacity=50)
    assert got.pinned == 1 and got.refused == {TIER_CAP: 2} and len(lru2.pins) == 1


def test_zero_fraction_turns_pins_off_and_zero_capacity_means_no_cap():
    lru, _ = lru_with([b"a"], max_pinned_fraction=0.0)
    assert lru.pin(pin_keys([b"a"]), 60, capacity=100).refused == {TIER_CAP: 1}
    unlimited, _ = lru_with([b"a"], max_pinned_fraction=0.5)
    assert unlimited.pin(pin_keys([b"a"]), 60, capacity=0).pinned == 1  # fs: 0 = unlimited


def test_tenant_quota_refuses_pins_over_its_share_and_pinned_bytes_count_against_it():
    clock = Clock()
    lru = TenantLRU({"t": 40}, max_pinned_fraction=0.5, clock=clock)  # t may pin 20 bytes
    for k in (b"a", b"b", b"d"):
        lru.add(k, "t", 10)
    lru.add(b"c", "other", 10)
    assert lru.pin(pin_keys([b"a", b"b"]), 60, capacity=1000).pinned == 2
    got = lru.pin(pin_keys([b"d", b"c"]), 60, capacity=1000)
    assert got.refused == {TENANT_QUOTA: 1} and got.pinned == 1  # other has no quota: c pinned
    assert b"d" in lru and b"d" not in lru.pins  # still held, unpinned
    lru.add(b"e", "t", 10)
    lru.add(b"f", "t", 10)  # t holds 50 > 40: over its quota
    assert lru.own_victim("t", 0) == b"d"  # its own oldest unpinned key goes, never a pinned one
    for k in (b"d", b"e", b"f"):
        lru.discard(k)
    assert lru.own_victim("t", 30) is None  # 20 pinned + 30 > 40, but nothing unpinned is left
    assert not lru.fits("t", 30) and lru.fits("t", 20)
    assert lru.pin_report()["tenant_pinned_bytes"] == {"other": 10, "t": 20}


def test_unpin_by_tenant_by_keys_and_all():
    lru, _ = lru_with([])
    for k, t in ((b"a1", "a"), (b"a2", "a"), (b"b1", "b"), (b"c1", "c")):
        lru.add(k, t, 10)
    lru.pin(pin_keys([b"a1", b"a2", b"b1", b"c1"]), 60, capacity=1000)
    assert lru.unpin(Unpin(tenants=("a",))) == 2
    assert lru.shared_victim(None) == b"a1"  # back under LRU, in their order
    assert lru.unpin(Unpin(keys=(b"c1", b"nope"))) == 1
    assert set(lru.pins.bytes_by_tenant()) == {"b"}
    assert lru.unpin(Unpin(everything=True)) == 1 and len(lru.pins) == 0
    with pytest.raises(ValueError, match="everything=True"):
        Unpin()


def test_discard_of_a_pinned_key_frees_its_pinned_bytes():
    lru, _ = lru_with([b"a", b"b"], tenant="t")
    lru.pin(pin_keys([b"a"]), 60, capacity=100)
    lru.discard(b"a")  # invalidation removes pinned keys too
    assert b"a" not in lru and len(lru.pins) == 0 and lru.pins.used("t") == 0
    assert lru.bytes_by_tenant() == {"t": 10}
    lru.discard(b"b")
    assert lru.bytes_by_tenant() == {} and lru.oldest() is None


def test_soonest_expiries_group_keys_pinned_together():
    lru, _ = lru_with([b"a", b"b", b"c"], tenant="t")
    lru.pin(pin_keys([b"a", b"b"]), 30, capacity=1000)
    lru.pin(pin_keys([b"c"]), 10, capacity=1000)
    assert lru.pin_report()["pin_expiries"] == [
        {"tenant": "t", "seconds_left": 10.0, "blocks": 1, "bytes": 10},
        {"tenant": "t", "seconds_left": 30.0, "blocks": 2, "bytes": 20},
    ]


def test_pin_batch_groups_by_ttl_longest_wins():
    batch = PinBatch((b"a", b"b", b"a", b"c"), (5.0, 5.0, 9.0, 0.0))
    assert batch.by_ttl() == {9.0: [b"a"], 5.0: [b"b"]}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (0.5, 0.5),
        (10**9, MAX_CACHE_TTL_S),  # capped
        (None, None),
        ("300", None),
        (True, None),
        (0, None),
        (-5, None),
        (math.nan, None),
        (math.inf, None),
        ([60], None),
        ({"s": 1}, None),
    ],
    ids=repr,
)
def test_request_ttl_value_ignores_what_is_not_seconds(value, seconds):
    assert request_ttl_value(value) == seconds


def test_cache_ttl_of_reads_the_field_then_the_params():
    assert cache_ttl_of(None) is None
    assert cache_ttl_of(ReqContext("r")) is None
    assert cache_ttl_of(ReqContext("r", {"cache_ttl_s": 60})) == 60.0
    assert cache_ttl_of(ReqContext("r", {"cache_ttl_s": "soon"})) is None  # ignored, never raises
    assert cache_ttl_of(ReqContext("r", {"cache_ttl_s": 60}, cache_ttl_s=5.0)) == 5.0
    assert cache_ttl_of(ReqContext("r", ["not", "a", "mapping"])) is None  # type: ignore[arg-type]


def test_next_expiry_per_tenant_is_the_soonest_of_its_pins():
    clock = Clock()
    lru = TenantLRU(clock=clock)
    for key, tenant in ((b"a", "t"), (b"b", "t"), (b"c", "u")):
        lru.add(key, tenant, 10)
    lru.pin(pin_keys([b"a"]), 30, capacity=1000)
    lru.pin(pin_keys([b"b"]), 10, capacity=1000)
    lru.pin(pin_keys([b"c"]), 60, capacity=1000)
    clock.now += 4
    assert lru.pins.next_expiry_by_tenant() == {"t": 6, "u": 56}
    clock.now += 7  # b's pin is past its deadline: 0 until an expiry pass unpins it
    assert lru.pins.next_expiry_by_tenant() == {"t": 0, "u": 49}
    lru.expire()
    assert lru.pins.next_expiry_by_tenant() == {"t": 19, "u": 49}
