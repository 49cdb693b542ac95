"""Pins in the fs root's index, without Ray: commits that carry TTLs pin their
files, floods and capacity cuts skip them, they expire, are capped and dropped."""

from __future__ import annotations

import numpy as np
import pytest

from raykv.core.contract import ReqContext, TransferJob
from raykv.core.fields import parse_options
from raykv.core.pins import TENANT_QUOTA, TIER_CAP, PinBatch, Unpin
from raykv.core.tenants import DEFAULT_TENANT
from raykv.core.validate import ConfigError
from tiers.fs.control import commit_batch
from tiers.fs.index import RootIndex
from tiers.fs.jobs import EXISTING, WRITTEN, BlockJob, Outcome
from tiers.fs.messages import CommitBatch
from tiers.fs.tier import FsOptions

SIZE = 10


class Clock:
    def __init__(self) -> None:
        self.now = 7.0

    def __call__(self) -> float:
        return self.now


def index(capacity_files: int, **kw: object) -> tuple[RootIndex, Clock]:
    clock = Clock()
    return RootIndex(capacity_files * SIZE, clock=clock, **kw), clock  # type: ignore[arg-type]


def batch(keys: list[bytes], ttl: float = 0.0, tenant: str = DEFAULT_TENANT) -> CommitBatch:
    n = len(keys)
    return CommitBatch(tuple(keys), (SIZE,) * n, (tenant,) * n, ttls=(ttl,) * n if ttl else ())


def ks(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def test_pinned_files_survive_a_flood_of_three_capacities_and_their_unpinned_twins_do_not():
    idx, _ = index(10)
    pinned, twin = ks("p", 3), ks("u", 3)
    assert idx.commit(batch(pinned, ttl=60)).pins.pinned == 3
    idx.commit(batch(twin))
    for i in range(15):  # 30 files: three times the capacity
        idx.commit(batch(ks(f"f{i}-", 2)))
        assert idx.bytes <= idx.capacity
    assert all(k in idx for k in pinned) and not any(k in idx for k in twin)
    report = idx.tenants.pin_report()
    assert report["pinned_blocks"] == 3 and report["tenant_pinned_bytes"] == {"": 3 * SIZE}


def test_expiry_frees_the_file_at_the_next_eviction_pass():
    idx, clock = index(4)
    idx.commit(batch([b"p"], ttl=0.5))
    idx.commit(batch(ks("a", 3)))
    assert idx.commit(batch([b"b"])).evicted == [b"a0"]
    clock.now += 0.6
    assert b"p" in idx  # no pass since: held, unpinned
    assert idx.commit(batch([b"c"])).evicted == [b"p"]


def test_a_later_commit_or_touch_with_a_ttl_extends_the_pin():
    idx, clock = index(3)
    idx.commit(batch([b"p"], ttl=1))
    clock.now += 0.9
    assert idx.pin(PinBatch((b"p",), (1.0,))).pinned == 1  # a touch by a request with a TTL
    clock.now += 0.9
    idx.commit(batch(ks("a", 3)))
    assert b"p" in idx
    clock.now += 0.2
    assert idx.commit(batch([b"z"])).evicted == [b"p"]


def test_tier_cap_refuses_and_still_stores_the_file():
    idx, _ = index(10, max_pinned_fraction=0.2)  # 2 files may be pinned
    done = idx.commit(batch(ks("p", 3), ttl=60))
    assert done.pins.pinned == 2 and done.pins.refused == {TIER_CAP: 1}
    assert all(k in idx for k in ks("p", 3)) and done.evicted == []


def test_tenant_quota_refuses_and_still_stores_the_file():
    idx, _ = index(100, tenant_quotas={"t": 6 * SIZE}, max_pinned_fraction=0.5)  # t may pin 3 files
    done = idx.commit(batch(ks("p", 4), ttl=60, tenant="t"))
    assert done.pins.pinned == 3 and done.pins.refused == {TENANT_QUOTA: 1}
    assert all(k in idx for k in ks("p", 4))


def test_only_pinned_files_left_evicts_the_new_unpinned_ones_and_keeps_the_pins():
    idx, _ = index(3, max_pinned_fraction=1.0)
    idx.commit(batch(ks("p", 3), ttl=60))
    done = idx.commit(batch([b"new"]))
    assert done.evicted == [b"new"] and done.held == []
    assert all(k in idx for k in ks("p", 3))
    assert idx.set_capacity(SIZE) == []  # a smaller capacity: pinned files wait for their expiry
    assert len(idx) == 3


def test_unpin_by_tenant_keys_and_all():
    idx, _ = index(100)
    for t in ("a", "b", "c"):
        idx.commit(batch(ks(t, 2), ttl=60, tenant=t))
    assert idx.unpin(Unpin(tenants=("a",))) == 2
    assert idx.unpin(Unpin(keys=(b"b0",))) == 1
    assert idx.tenants.pins.bytes_by_tenant() == {"b": SIZE, "c": 2 * SIZE}
    assert idx.unpin(Unpin(everything=True)) == 3
    assert idx.set_capacity(4 * SIZE) == [b"a0", b"a1"]  # plain LRU again


def test_dropping_an_identity_drops_its_pins():
    idx, _ = index(100)
    idx.commit(batch([b"old:1", b"old:2", b"new:1"], ttl=60))
    assert idx.drop(idx.with_prefix([b"old:"])) == [b"old:1", b"old:2"]
    assert idx.tenants.pin_report()["pinned_blocks"] == 1 and idx.tenants.pins.total == SIZE


def test_commit_batch_carries_each_job_s_ttl():
    def job(keys, ttl):
        req = ReqContext("r", {"cache_ttl_s": ttl} if ttl else None)
        state = BlockJob(TransferJob(1, keys, np.arange(len(keys)), False, req), list(keys), list(range(len(keys))))
        for i in range(len(keys)):
            state.done(i, Outcome(WRITTEN if i else EXISTING, SIZE))
        return state

    assert commit_batch([job([b"a", b"b"], 30), job([b"c"], None)]).ttls == (30.0, 30.0, 0.0)
    assert commit_batch([job([b"c"], None)]).ttls == ()
    assert commit_batch([job([b"d"], "bad")]).ttls == ()  # a malformed TTL is ignored


@pytest.mark.parametrize("bad", [2, -1, "x"])
def test_max_pinned_fraction_is_validated_naming_the_field(bad):
    with pytest.raises(ConfigError) as e:
        parse_options(FsOptions, {"root": "/mnt/kv", "max_pinned_fraction": bad}, "secondary_tiers[1]")
    assert e.value.field == "secondary_tiers[1].max_pinned_fraction"


def test_max_pinned_fraction_reaches_the_actor_settings():
    assert FsOptions(root="/mnt/kv", max_pinned_fraction=0.3).actor_settings().max_pinned_fraction == 0.3
