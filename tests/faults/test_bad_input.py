"""Bad input on a real local Ray: malformed keys, oversized blocks, a
read-only root, every invalid config field. Each gives a clear error or a
miss; never an exception into the engine, never a partial or wrong block."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess

import numpy as np
import pytest
import ray

from raykv.client import TierDriver
from raykv.config import ConfigError, RaykvConfig
from raykv.contract import LookupResult, ReqContext, TransferJob
from raykv.factory import TierFactory
from raykv.keys import prefix_keys
from raykv.primary import PrimaryRegion

BLOCK = 64 * 1024
_ids = itertools.count(50_000)
_seed = itertools.count(1)


def _keys(n: int) -> list[bytes]:
    base = next(_seed) * 77_777
    return prefix_keys(list(range(base, base + 10 * n)), 10)


def _run(tier, kind: str, keys: list, chunks: list, timeout: float = 20.0):
    """Submit one job; it must not raise and must end in exactly one result."""
    job = TransferJob(next(_ids), keys, np.asarray(chunks, dtype=np.int64), kind == "load", ReqContext("bad"))
    (tier.submit_load if kind == "load" else tier.submit_store)(job)
    drv = TierDriver(tier)
    res = drv._wait(job.job_id, timeout)
    tier.on_schedule_end()
    assert not [r for r in tier.get_finished_jobs() if r.job_id == job.job_id], "reported twice"
    return res


@pytest.fixture(params=["object_store", "fs"])
def tier(request, raykv_services, tmp_path):
    region = PrimaryRegion(8, BLOCK)
    cfg = {"type": request.param}
    if request.param == "fs":
        cfg.update(root=str(tmp_path / "kv"), fsync=False)
    else:
        cfg.update(capacity_bytes=4 * BLOCK)
    t = TierFactory.create_tier(cfg, region.view, services=raykv_services)
    yield t, region
    t.shutdown()
    region.close()


MALFORMED = ["abcdefgh", 12345, None, b"", b"abc", b"x" * 300, 3.5]


def test_malformed_keys_miss_and_fail_cleanly(tier):
    t, region = tier
    good = _keys(3)
    region.array[:3] = np.random.default_rng(1).integers(0, 256, (3, BLOCK), dtype=np.uint8)
    assert TierDriver(t).store(good, [0, 1, 2]).success
    ctx = ReqContext("bad")
    # a malformed key is a miss, and does not spoil the batch of good keys next to it
    t._cache.invalidate(good)
    for _ in range(2000):
        answers = [t.lookup(k, ctx) for k in [*MALFORMED, *good]]
        t.on_schedule_end()
        if LookupResult.RETRY not in answers:
            break
    assert answers == [LookupResult.MISS] * len(MALFORMED) + [LookupResult.HIT] * 3
    # a job with a malformed key fails as a whole, with a clear error, and touches nothing
    for bad in MALFORMED:
        for kind in ("store", "load"):
            res = _run(t, kind, [good[0], bad], [3, 4])
            assert not res.success and "key" in res.error, (kind, bad, res.error)
    # 12345 must not turn into 12345 zero bytes, b"abc" into a short key...: nothing registered
    assert not any(t.services.directory.lookup([bytes(5), b"x" * 300, b"abcdefgh"]))
    assert TierDriver(t).load(good, [5, 6, 7]).success
    assert np.array_equal(region.array[5:8], region.array[0:3])


def test_oversized_and_mismatched_jobs(tier):
    t, region = tier
    keys = _keys(8)
    if t.tier_type == "object_store":  # more than the whole capacity (4 blocks): a clear failure
        res = _run(t, "store", keys, list(range(8)))
        assert not res.success and "capacity" in res.error, res.error
        assert t.lookup_blocking(keys) == [LookupResult.MISS] * 8
    for chunks in ([0], [0, 99], [-1, 0]):  # wrong count, out of range
        for kind in ("store", "load"):
            res = _run(t, kind, keys[:2], chunks)
            assert not res.success, (kind, chunks)
            # only keys with a valid slot may have gone through (fs stores key by key)
            assert all(c == 0 for k, c in zip(keys[:2], chunks) if k in set(res.successful_keys or ())), res
    held = t.lookup_blocking(keys[:2])
    if t.tier_type == "object_store":  # a job with a bad slot stores nothing
        assert held == [LookupResult.MISS] * 2
    else:  # fs stores key by key: each key went through from its one valid slot (0), and said so
        assert held == [LookupResult.HIT] * 2


def test_block_size_mismatch_is_never_served(raykv_services, tmp_path):
    """A block stored from 64 KiB chunks is not loaded into 32 KiB chunks (or vice versa)."""
    keys = _keys(2)
    for cfg in ({"type": "object_store"}, {"type": "fs", "root": str(tmp_path / "kv"), "fsync": False}):
        with PrimaryRegion(2, BLOCK) as big, PrimaryRegion(2, BLOCK // 2) as small:
            big.array[:] = 7
            small.array[:] = 0
            w = TierFactory.create_tier(cfg, big.view, services=raykv_services)
            r = TierFactory.create_tier(cfg, small.view, services=raykv_services)
            assert TierDriver(w).store(keys, [0, 1]).success
            res = TierDriver(r).load(keys, [0, 1])
            assert not res.success and not res.successful_keys, res
            assert not small.array.any(), "a partial block was copied"
            w.shutdown()
            r.shutdown()


@pytest.fixture
def readonly_root(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_read_only_root(raykv_services, readonly_root):
    root = readonly_root / "kv"
    keys = _keys(4)
    with PrimaryRegion(4, BLOCK) as src, PrimaryRegion(4, BLOCK) as dst:
        src.array[:] = np.random.default_rng(3).integers(0, 256, src.array.shape, dtype=np.uint8)
        t = TierFactory.create_tier({"type": "fs", "root": str(root), "fsync": False}, src.view, services=raykv_services)
        assert TierDriver(t).store(keys[:2], [0, 1]).success
        # the shared filesystem goes read-only (as NFS does on a server problem)
        assert subprocess.run(["mount", "-o", "remount,ro", str(readonly_root)]).returncode == 0
        try:
            res = TierDriver(t).store(keys[2:], [2, 3])
            assert not res.success and "EROFS" in res.error, res.error
            assert t.lookup_blocking(keys) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2
            r = TierFactory.create_tier({"type": "fs", "root": str(root)}, dst.view, services=raykv_services)
            assert TierDriver(r).load(keys[:2], [0, 1]).success  # reads still work
            assert np.array_equal(dst.array[:2], src.array[:2])
            r.shutdown()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(readonly_root)])
        t.shutdown()


# -- config ---------------------------------------------------------------------------
def _bad_values(f: dataclasses.Field) -> list:
    kind = f.metadata["kind"]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    out: list = [object()]  # never a valid type
    if str not in kinds:
        out.append("nope")
    if bool not in kinds:
        out.append(True)
    if f.metadata.get("min") is not None:
        out.append(type(f.default)(f.metadata["min"]) - 1 if f.default is not None else -1)
    if f.metadata.get("check") is not None and str in kinds:
        out.append("")
    return out


def _schemas():
    from raykv.factory import TierFactory as F

    out = [("raykv", RaykvConfig, lambda d: RaykvConfig.from_dict(d))]
    for tier_type in F.known_types():
        cls = F.get_tier_class({"type": tier_type})
        base = {"type": tier_type, **({"root": "/tmp/x"} if tier_type == "fs" else {})}
        out.append((tier_type, cls.Options, lambda d, base=base: F.parse({**base, **d})))
    return out


def test_every_invalid_config_field_is_named():
    checked = 0
    for name, schema, parse in _schemas():
        for f in dataclasses.fields(schema):
            for bad in _bad_values(f):
                with pytest.raises(ConfigError) as e:
                    parse({f.name: bad})
                assert f.name in str(e.value), (name, f.name, bad, str(e.value))
                checked += 1
        with pytest.raises(ConfigError, match="unknown key; allowed keys"):
            parse({"no_such_option": 1})
    print(f"\n{checked} invalid config values rejected, each naming its field")
    assert checked > 30
