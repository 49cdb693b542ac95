"""Offload keys: vLLM's layout, prefix chaining, salts."""

from __future__ import annotations

import pytest

from raykv.core.keys import (
    key_block_hash,
    key_group_idx,
    make_offload_key,
    prefix_keys,
    shard_of,
    validate_key,
)


def test_key_layout_matches_vllm():
    key = make_offload_key(b"\x01" * 32, 3)
    assert key == b"\x01" * 32 + b"\x00\x00\x00\x03"
    assert key_block_hash(key) == b"\x01" * 32 and key_group_idx(key) == 3


def test_prefix_chaining():
    a = prefix_keys(list(range(40)), 10)
    b = prefix_keys(list(range(30)) + [99] * 10, 10)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    # changing an early token changes every later key
    c = prefix_keys([7] + list(range(1, 40)), 10)
    assert all(x != y for x, y in zip(a, c))
    assert prefix_keys(list(range(39)), 10) == a[:3]  # partial blocks have no key


def test_salt_separates_tenants():
    tokens = list(range(64))
    plain = prefix_keys(tokens, 16)
    tenant_a = prefix_keys(tokens, 16, salt="tenant-a")
    tenant_b = prefix_keys(tokens, 16, salt="tenant-b")
    assert not set(plain) & set(tenant_a)
    assert not set(tenant_a) & set(tenant_b)
    assert tenant_a == prefix_keys(tokens, 16, salt="tenant-a")


def test_bad_keys_and_sizes():
    with pytest.raises(ValueError, match="bytes"):
        validate_key("abc")
    with pytest.raises(ValueError, match="5..256"):
        validate_key(b"abc")
    with pytest.raises(ValueError, match="block_size"):
        prefix_keys([1, 2], 0)


def test_shards_spread_evenly():
    keys = prefix_keys(list(range(40000)), 4)
    counts = [0, 0, 0, 0]
    for k in keys:
        counts[shard_of(k, 4)] += 1
    assert min(counts) > 0.8 * len(keys) / 4


def test_scoped_keys_spread_evenly_and_vectorized_split_agrees():
    from raykv.core.identity import KVIdentity, scope_key
    from raykv.directory.client import shard_ids

    tag = KVIdentity(model="m").tag
    keys = [scope_key(tag, k) for k in prefix_keys(list(range(40000)), 4)]
    counts = [0, 0, 0, 0]
    for k in keys:
        counts[shard_of(k, 4)] += 1
    assert min(counts) > 0.8 * len(keys) / 4  # the shared tag does not pick the shard
    assert list(shard_ids(keys, 4)) == [shard_of(k, 4) for k in keys]
