"""Storage backends without Ray: local paths and pyarrow.fs (Arrow's in-memory
``mock://`` filesystem stands in for a non-POSIX store)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from raykv.core.keys import prefix_keys
from tiers.fs import format as fmt
from tiers.fs.storage import ArrowStorage, LocalStorage, open_storage

BLOCK = 8192


def _backends(tmp_path):
    local = LocalStorage(str(tmp_path / "local"))
    arrow_local = open_storage(f"file://{tmp_path}/arrow")
    mock = ArrowStorage("mock:///kv/root")
    # an object store (s3/gcs branch: one put per block, no temp file, no directories)
    import pyarrow.fs as pafs

    memory = pytest.importorskip("fsspec.implementations.memory")  # fsspec comes with torch
    put = ArrowStorage("bucket/prefix", filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(memory.MemoryFileSystem())))
    put.atomic_put = True
    return {"local": local, "arrow-file": arrow_local, "arrow-mock": mock, "arrow-put": put}


@pytest.mark.parametrize("name", ["local", "arrow-file", "arrow-mock", "arrow-put"])
def test_backend_store_load_scan_delete(tmp_path, name):
    st = _backends(tmp_path)[name]
    st.ensure_root()
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = prefix_keys(list(range(40)), 10)
    long_key = bytes(range(150)) + b"\0\0\0\0"  # named by its sha256
    keys[3] = long_key
    for i, k in enumerate(keys):
        assert st.existing_size(k) is None
        size = st.store(k, memoryview(src[i]), fsync=True)
        assert size == fmt.header_size(len(k)) + BLOCK == st.existing_size(k)
    for i, k in enumerate(keys):
        st.load(k, memoryview(dst[3 - i]))
    assert np.array_equal(src, dst[::-1])
    found = {e.key: e.size for e in st.scan()}
    assert found == {k: fmt.header_size(len(k)) + BLOCK for k in keys}
    with pytest.raises(FileNotFoundError):
        st.load(prefix_keys(list(range(99, 109)), 10)[0], memoryview(dst[0]))
    with pytest.raises(fmt.FormatError):
        st.load(keys[0], memoryview(dst[0])[:100])  # wrong block size
    assert st.delete(keys[:2]) == 2 and st.delete(keys[:2]) == 0
    assert {e.key for e in st.scan()} == set(keys[2:])


@pytest.mark.parametrize("name", ["local", "arrow-file", "arrow-mock", "arrow-put"])
def test_sweep_of_temp_files_on_every_backend(tmp_path, name, caplog):
    """A sweep before any store finds nothing and says nothing (the root's actor sweeps every
    15 min); a finished store leaves no temp file behind (stale ones: test_fs_tier.py)."""
    st = _backends(tmp_path)[name]
    st.ensure_root()
    with caplog.at_level(logging.WARNING):
        assert st.sweep_tmp(0.0) == []
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    key = prefix_keys(list(range(10)), 10)[0]
    st.store(key, memoryview(bytearray(BLOCK)), fsync=False)
    assert st.sweep_tmp(0.0) == []
    assert key in {e.key for e in st.scan()}  # (the in-memory object store is shared by tests)


def test_scan_removes_stale_temp_files_only(tmp_path):
    st = LocalStorage(str(tmp_path / "kv"))
    st.ensure_root()
    key = prefix_keys(list(range(10)), 10)[0]
    st.store(key, memoryview(bytearray(BLOCK)), fsync=False)
    d = os.path.dirname(st.path_of(key))
    stale, fresh = os.path.join(d, ".x.kv.1.tmp"), os.path.join(d, ".y.kv.2.tmp")
    for p in (stale, fresh):
        open(p, "wb").close()
    old = time.time() - 7200
    os.utime(stale, (old, old))
    open(os.path.join(d, "not-a-block.txt"), "wb").close()
    assert [e.key for e in st.scan(tmp_max_age_s=3600)] == [key]
    assert not os.path.exists(stale) and os.path.exists(fresh)


def test_scan_reports_every_block_file_it_removes(tmp_path):
    """Unreadable and misnamed hashed-name files go at scan, each reported with its path
    (the root actor counts and logs them: raykv.metrics.incidents)."""
    st = LocalStorage(str(tmp_path / "kv"))
    st.ensure_root()
    long_key = bytes(8) + bytes(range(200))  # over MAX_HEX_NAME_KEY: a hashed name
    other = bytes(8) + bytes(range(1, 201))
    st.store(long_key, memoryview(bytearray(BLOCK)), fsync=False)
    d = os.path.dirname(st.path_of(long_key))
    garbage = [os.path.join(d, f"h{i:064x}.kv") for i in range(3)]
    for p in garbage:
        with open(p, "wb") as f:
            f.write(b"not a block file")
    st.store(other, memoryview(bytearray(BLOCK)), fsync=False)
    misnamed = os.path.join(d, "h" + "f" * 64 + ".kv")
    os.rename(st.path_of(other), misnamed)
    assert [e.key for e in st.scan()] == [long_key]
    removed = st.scan_removals()
    assert sorted(r.path for r in removed["unreadable"]) == sorted(garbage)
    assert [r.path for r in removed["misnamed"]] == [misnamed] and removed["misnamed"][0].key == other.hex()
    assert not any(os.path.exists(p) for p in [*garbage, misnamed])
    assert st.scan_removals() == {}


def test_local_files_are_owner_only(tmp_path):
    st = LocalStorage(str(tmp_path / "kv"))
    st.ensure_root()
    key = prefix_keys(list(range(10)), 10)[0]
    st.store(key, memoryview(bytearray(BLOCK)), fsync=True)
    p = st.path_of(key)
    assert os.stat(p).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(p)).st_mode & 0o777 == 0o700
    assert os.stat(str(tmp_path / "kv")).st_mode & 0o777 == 0o700


def test_gcs_uris_get_a_retry_limit_unless_they_set_their_own():
    from tiers.fs.storage import GCS_RETRY_LIMIT_S, bounded_uri

    limit = f"retry_limit_seconds={GCS_RETRY_LIMIT_S}"
    assert bounded_uri("gs://bucket/kv") == f"gs://bucket/kv?{limit}"
    assert bounded_uri("GCS://bucket/kv?anonymous=true") == f"GCS://bucket/kv?anonymous=true&{limit}"
    assert bounded_uri("gs://bucket/kv?retry_limit_seconds=120") == "gs://bucket/kv?retry_limit_seconds=120"
    for other in ("s3://bucket/kv", "file:///mnt/kv", "mock:///kv", "/mnt/kv"):
        assert bounded_uri(other) == other


@pytest.mark.timeout(120)
def test_a_gcs_root_that_does_not_answer_fails_within_the_retry_limit(monkeypatch):
    """A bucket the host cannot reach (no credentials or no network, as here): pyarrow's GCS
    client retried each call for 15 minutes, so `raykv start` with such a root hung that long.
    Now its scan (the root actor's first call) gives up after the retry limit, or, where GCS
    does answer (a GCP host), returns: either way in seconds."""
    from tiers.fs import storage

    monkeypatch.setattr(storage, "GCS_RETRY_LIMIT_S", 2)
    gcs = ArrowStorage("gs://raykv-test-no-such-bucket-7f3a/kv")
    t0 = time.monotonic()
    try:
        gcs.scan()
    except OSError:  # the usual outcome: no token could be had within the retry limit
        pass
    assert time.monotonic() - t0 < 60
