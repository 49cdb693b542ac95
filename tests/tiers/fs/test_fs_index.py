"""The root actor's bookkeeping without Ray: ``RootIndex`` (LRU, capacity,
tenant quotas, scans), the jobs' progress and the messages the control
thread builds."""

from __future__ import annotations

import numpy as np

from raykv.core.contract import ReqContext, TransferJob
from raykv.core.tenants import DEFAULT_TENANT
from tiers.fs.control import commit_batch, removals_by_reason
from tiers.fs.index import RootIndex
from tiers.fs.jobs import CORRUPT, ERROR, EXISTING, MISSING, OK, WRITTEN, BlockJob, Outcome
from tiers.fs.messages import DEFAULT_CAPACITY_BYTES, CommitBatch, FsRootSettings
from tiers.fs.storage import FileEntry
from tiers.fs.tier import FsOptions


def _batch(keys, size=10, tenant=DEFAULT_TENANT, verify=()):
    return CommitBatch(tuple(keys), (size,) * len(keys), (tenant,) * len(keys), frozenset(verify))


def _k(i: int) -> bytes:
    return bytes([i]) * 12


def test_commit_holds_new_keys_and_reports_what_it_added():
    index = RootIndex(0)
    done = index.commit(_batch([_k(1), _k(2)]))
    assert done.held == [_k(1), _k(2)] and done.new == [_k(1), _k(2)] and done.evicted == [] and done.added == 2
    again = index.commit(_batch([_k(2), _k(3)], size=30))
    assert again.held == [_k(2), _k(3)] and again.new == [_k(3)] and again.added == 1
    assert len(index) == 3 and index.bytes == 10 + 30 + 30  # a re-committed key takes its new size
    assert index.keys() == [_k(1), _k(2), _k(3)]  # re-committed: most recently used


def test_missing_keys_are_not_taken_in():
    index = RootIndex(0)
    done = index.commit(_batch([_k(1), _k(2)], verify=[_k(2)]), missing={_k(2)})
    assert done.held == [_k(1)] and _k(2) not in index and index.bytes == 10


def test_capacity_evicts_least_recently_used_first():
    index = RootIndex(30)
    index.commit(_batch([_k(1), _k(2), _k(3)]))
    index.touch([_k(1), _k(9)])  # an unknown key is ignored
    done = index.commit(_batch([_k(4)]))
    assert done.evicted == [_k(2)] and done.held == [_k(4)]
    assert index.keys() == [_k(3), _k(1), _k(4)] and index.bytes == 30


def test_a_batch_over_the_capacity_evicts_its_own_keys():
    index = RootIndex(20)
    done = index.commit(_batch([_k(1), _k(2), _k(3), _k(4)]))
    assert done.evicted == [_k(1), _k(2)] and done.held == [_k(3), _k(4)] and done.new == [_k(3), _k(4)]
    assert done.added == 4  # counted as committed, evicted or not


def test_zero_capacity_is_unlimited_and_a_smaller_one_evicts():
    index = RootIndex(0)
    index.commit(_batch([_k(i) for i in range(10)]))
    assert len(index) == 10
    assert index.set_capacity(35) == [_k(i) for i in range(7)]
    assert index.keys() == [_k(7), _k(8), _k(9)] and index.capacity == 35


def test_a_tenant_over_its_quota_evicts_its_own_files_first():
    index = RootIndex(100, {"a": 20})
    index.commit(_batch([_k(1), _k(2)], tenant="b"))
    index.commit(_batch([_k(3), _k(4)], tenant="a"))
    done = index.commit(_batch([_k(5)], tenant="a"))
    assert done.evicted == [_k(3)]  # a's oldest, not b's older files
    assert index.tenants.bytes_by_tenant() == {"a": 20, "b": 20}


def test_drop_and_prefix_lookup():
    index = RootIndex(0)
    keys = [b"tagA" + bytes([i]) for i in range(3)] + [b"tagB" + bytes([i]) for i in range(2)]
    index.commit(_batch(keys))
    assert index.with_prefix([b"tagB"]) == keys[3:]
    assert index.drop([keys[0], _k(7)]) == [keys[0]]  # only held keys are reported
    assert keys[0] not in index and index.bytes == 40 and index.tenants.bytes_by_tenant() == {DEFAULT_TENANT: 40}


def test_adopt_orders_scanned_files_by_mtime_and_fits_the_capacity():
    index = RootIndex(25)
    found = [FileEntry(_k(1), 10, 300.0), FileEntry(_k(2), 10, 100.0), FileEntry(_k(3), 10, 200.0)]
    assert index.adopt(found) == [_k(2)]  # the oldest goes
    assert index.keys() == [_k(3), _k(1)]
    assert index.tenants.bytes_by_tenant() == {DEFAULT_TENANT: 20}


def _job(keys, outcomes, tenant=None):
    job = TransferJob(1, keys, np.arange(len(keys)), False, ReqContext("r", tenant=tenant))
    state = BlockJob(job, list(keys), list(range(len(keys))))
    assert [state.done(i, o) for i, o in enumerate(outcomes)] == [False] * (len(keys) - 1) + [True]
    return state


def test_block_job_outcomes_and_summary():
    state = _job([_k(i) for i in range(5)], [Outcome(OK, 8)] + [Outcome(MISSING, detail=f"gone {i}") for i in range(4)])
    assert state.with_kind(OK) == [0] and state.with_kind(MISSING, CORRUPT) == [1, 2, 3, 4]
    text = state.summary([1, 2, 3, 4], "not loaded")
    assert text.startswith("4 of 5 keys not loaded: ") and "missing (gone 0)" in text and text.endswith("; +1 more")


def test_commit_batch_has_every_stored_block_of_every_job():
    a = _job([_k(1), _k(2), _k(3)], [Outcome(WRITTEN, 11), Outcome(ERROR, detail="EIO"), Outcome(EXISTING, 12)], "t1")
    b = _job([_k(4)], [Outcome(WRITTEN, 13)])
    batch = commit_batch([a, b])
    assert batch == CommitBatch((_k(1), _k(3), _k(4)), (11, 12, 13), ("t1", "t1", DEFAULT_TENANT), frozenset({_k(3)}))


def test_removals_are_grouped_by_reason_with_their_details():
    a = _job([_k(1), _k(2)], [Outcome(CORRUPT, detail="bad crc"), Outcome(MISSING, detail="ENOENT")])
    b = _job([_k(3)], [Outcome(CORRUPT, detail="short")])
    assert removals_by_reason([(a, [0, 1]), (b, [0])]) == {
        CORRUPT: ([_k(1), _k(3)], ["bad crc", "short"]),
        MISSING: ([_k(2)], ["ENOENT"]),
    }


def test_actor_settings_come_from_the_options():
    options = FsOptions(root="/mnt/share//kv/", tenant_quotas={"a": 5})
    assert options.capacity_bytes == DEFAULT_CAPACITY_BYTES
    assert options.actor_settings() == FsRootSettings("/mnt/share/kv", DEFAULT_CAPACITY_BYTES, {"a": 5})
    assert FsRootSettings("/r").capacity_bytes == DEFAULT_CAPACITY_BYTES  # one default, in messages.py
