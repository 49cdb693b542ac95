"""Block file format, names and options of the fs tier (no Ray needed)."""

from __future__ import annotations

import os
import zlib

import pytest

import raykv
from raykv.core.factory import TierFactory
from raykv.core.identity import KVIdentity
from raykv.core.keys import prefix_keys
from raykv.core.validate import ConfigError
from tiers.fs import format as fmt
from tiers.fs.io_pool import LOAD, STORE, IoPool
from tiers.fs.storage import canonical_root


@pytest.mark.parametrize("algo", fmt.available_algorithms())
def test_header_roundtrip_and_verify(algo):
    key = prefix_keys(list(range(10)), 10)[0]
    payload = memoryview(bytearray(os.urandom(4096)))
    head = fmt.encode_header(key, payload, fmt.ALGORITHMS[algo])
    assert len(head) == fmt.header_size(len(key)) and len(head) % fmt.ALIGN == 0
    h = fmt.decode_header(head)
    assert (h.key, h.payload_len, h.header_len) == (key, 4096, len(head))
    fmt.verify(head, key, payload, len(head) + len(payload))

    with pytest.raises(fmt.FormatError, match="checksum"):
        bad = bytearray(payload)
        bad[100] ^= 1
        fmt.verify(head, key, memoryview(bad), len(head) + len(payload))
    with pytest.raises(fmt.FormatError, match="truncated"):
        fmt.verify(head, key, payload, len(head) + len(payload) - 1)
    with pytest.raises(fmt.FormatError, match="another key"):
        fmt.verify(head, prefix_keys(list(range(20)), 10)[1], payload, len(head) + len(payload))
    broken = bytearray(head)
    broken[40] ^= 0xFF  # inside the key: header checksum catches it
    with pytest.raises(fmt.FormatError, match="header checksum"):
        fmt.decode_header(broken)
    with pytest.raises(fmt.FormatError, match="magic"):
        fmt.decode_header(b"XXXX" + head[4:])


def test_checksum_choice():
    assert "crc32" in fmt.available_algorithms()
    assert fmt.resolve_algorithm("crc32") == 1
    assert fmt.ALGORITHM_NAMES[fmt.resolve_algorithm("auto")] == fmt.available_algorithms()[0]
    payload = b"x" * 10_000
    assert fmt.checksum_impl(1)(payload) == zlib.crc32(payload)
    with pytest.raises(fmt.ChecksumUnavailable, match="not available"):
        fmt.checksum_impl(99)
    for algo in set(fmt.ALGORITHMS) - set(fmt.available_algorithms()):  # e.g. xxh3 without xxhash
        with pytest.raises(ConfigError) as e:
            TierFactory.parse({"type": "fs", "root": "/x", "checksum": algo})
        assert e.value.field == "tier.checksum" and "pip install" in str(e.value)


def test_paths_come_only_from_key_hex():
    tag = KVIdentity(model="m").tag
    key = tag + prefix_keys(list(range(10)), 10)[0]
    hexkey = key.hex()
    # one folder per identity tag, then a 3-digit fan-out of the block hash
    assert fmt.rel_path(key) == f"{tag.hex()}/{hexkey[16:19]}/{hexkey}.kv"
    assert fmt.is_identity_dir(tag.hex()) and fmt.is_fan_dir(hexkey[16:19])
    assert fmt.key_from_name(fmt.file_name(key)) == key
    # a hostile key is still just hex digits
    evil = b"../../etc/passwd\x00\x00\x00\x00"
    assert "/" not in fmt.file_name(evil) and ".." not in fmt.rel_path(evil)
    long_key = bytes(range(200))
    name = fmt.file_name(long_key)
    assert name.startswith("h") and len(name) < 100 and fmt.key_from_name(name) is None
    assert not fmt.is_tmp_name(name) and fmt.is_tmp_name(".abc.kv.1234.tmp")


def test_canonical_root():
    assert canonical_root("/a/b/../c/") == "/a/c"
    assert canonical_root("S3://bucket/prefix/") == "s3://bucket/prefix"
    assert canonical_root("file:///tmp/x/") == "file:///tmp/x"


@pytest.mark.parametrize(
    "config, field",
    [
        ({"type": "fs"}, "tier.root"),
        ({"type": "fs", "root": ""}, "tier.root"),
        ({"type": "fs", "root": "relative/dir"}, "tier.root"),
        ({"type": "fs", "root": "s3://"}, "tier.root"),
        ({"type": "fs", "root": "/mnt/kv", "capacity_bytes": -1}, "tier.capacity_bytes"),
        ({"type": "fs", "root": "/mnt/kv", "capacity_bytes": "1G"}, "tier.capacity_bytes"),
        ({"type": "fs", "root": "/mnt/kv", "io_threads": 0}, "tier.io_threads"),
        ({"type": "fs", "root": "/mnt/kv", "fsync": "yes"}, "tier.fsync"),
        ({"type": "fs", "root": "/mnt/kv", "bogus": 1}, "tier.bogus"),
        ({"type": "fs", "root": "/mnt/kv", "checksum": "md5"}, "tier.checksum"),
    ],
)
def test_config_errors_name_the_field(config, field):
    with pytest.raises(ConfigError) as e:
        TierFactory.parse(config)
    assert e.value.field == field
    assert field in str(e.value)


def test_config_error_inside_raykv_config():
    with pytest.raises(ConfigError) as e:
        raykv.RaykvConfig.from_dict({"tiers": [{"type": "fs", "root": "/x"}, {"type": "fs"}]})
    assert e.value.field == "tiers[1].root"


def test_io_pool_serves_loads_before_stores():
    import threading

    pool = IoPool(1)
    gate = threading.Event()
    order: list[str] = []
    pool.submit(STORE, gate.wait)  # occupies the only worker
    pool.submit_many(STORE, [(lambda i=i: order.append(f"s{i}"), None) for i in range(3)])
    pool.submit_many(LOAD, [(lambda i=i: order.append(f"l{i}"), None) for i in range(2)])
    gate.set()
    assert pool.wait_idle(5)
    assert order == ["l0", "l1", "s0", "s1", "s2"]
    cancelled: list[int] = []
    pool.submit(STORE, gate.clear)
    pool.shutdown()
    pool.submit(LOAD, lambda: order.append("late"), lambda: cancelled.append(1))
    assert cancelled == [1] and "late" not in order
