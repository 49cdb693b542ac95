"""Batched fingerprints: one function whatever the batch, well mixed, and the
client's single-pass key checks."""

from __future__ import annotations

import os

import numpy as np
import pytest

from raykv.core.keys import bytes_and_length, checked_keys, shard_of
from raykv.core.validate import ArgumentError
from raykv.directory.client import shard_ids
from raykv.directory.fingerprint import EMPTY, PackedKeys, fingerprint, fingerprints
from raykv.directory.fptable import FingerprintTable


def test_a_key_has_one_fingerprint_whatever_batch_it_is_in():
    rng = np.random.default_rng(1)
    keys = [os.urandom(int(n)) for n in rng.integers(5, 80, 500)] + [os.urandom(44) for _ in range(200)]
    batch = fingerprints(keys)
    assert [fingerprint(k) for k in keys] == batch.tolist()
    same = [k for k in keys if len(k) == 44]
    assert fingerprints(same).tolist() == [fingerprint(k) for k in same]  # the one-length path
    assert fingerprints(keys[:5]).tolist() == batch[:5].tolist()  # a small batch: key by key in Python
    assert EMPTY not in batch.tolist()


def test_keys_differing_in_trailing_zeros_or_length_differ():
    body = bytes(range(1, 41))
    keys = [body + b"\0" * i for i in range(9)] + [b"\0" * i for i in range(1, 20)]
    assert len(set(fingerprints(keys).tolist())) == len(keys)


def test_fingerprints_are_distinct_and_spread_over_buckets():
    tag = b"\x5c" * 8
    keys = [tag + i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(200_000)]  # low-entropy keys
    fps = fingerprints(keys)
    assert len(np.unique(fps)) == len(keys)
    buckets = np.bincount((fps & np.uint64(1023)).astype(np.int64), minlength=1024)
    assert buckets.min() > 0.75 * len(keys) / 1024 and buckets.max() < 1.25 * len(keys) / 1024
    high = np.bincount((fps >> np.uint64(54)).astype(np.int64), minlength=1024)
    assert high.min() > 0.75 * len(keys) / 1024 and high.max() < 1.25 * len(keys) / 1024
    table = FingerprintTable()
    table.reserve(len(fps))
    slots = table.insert(fps)
    assert (table.find(fps) == slots).all()


def test_packed_keys_and_vectorised_shards_match_per_key_rules():
    keys = [os.urandom(n) for n in (12, 44, 44, 20, 100, 13)]
    packed = PackedKeys(keys)
    assert packed.lengths.tolist() == [len(k) for k in keys]
    assert packed.length is None
    assert shard_ids(packed, 3).tolist() == [shard_of(k, 3) for k in keys]
    assert shard_ids([b"short-key"], 3) is None  # under 12 bytes: the caller's per-key rule


def test_single_pass_key_checks_name_the_bad_key_and_the_common_length():
    keys = [os.urandom(44) for _ in range(10)]
    assert checked_keys(keys) == (keys, 44)
    assert checked_keys(keys + [os.urandom(40)])[1] is None
    out, length = checked_keys([bytearray(b"x" * 44), memoryview(b"y" * 44)])
    assert out == [b"x" * 44, b"y" * 44] and length == 44 and all(type(k) is bytes for k in out)
    with pytest.raises(ArgumentError, match=r"keys\[1\]"):
        checked_keys([os.urandom(44), "not bytes"])
    with pytest.raises(ArgumentError, match=r"keys\[0\]"):
        checked_keys([b"abc"])
    assert bytes_and_length((bytearray(b"k" * 20),)) == ([b"k" * 20], 20)
    assert bytes_and_length([]) == ([], None)
