"""Bad input on a real local Ray: malformed keys, oversized blocks, a
read-only root, every invalid config field. Each gives a clear error or a
miss; never an exception into the engine, never a partial or wrong block."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from raykv.config.options import RaykvConfig
from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.core.validate import ConfigError
from raykv.core.wire import HolderInfo
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.clusters import start_local_ray
from tiers.fs.messages import FsRootSettings
from tiers.object_store.messages import ObjectStoreSettings

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
    res = drv.wait(job.job_id, timeout)
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
    # (lookup_async: the directory as it is; the blocking lookup refuses a 300-byte key up front)
    assert not any(t.services.directory.lookup_async([bytes(5), b"x" * 300, b"abcdefgh"]).result(30))
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
        t = TierFactory.create_tier(
            {"type": "fs", "root": str(root), "fsync": False}, src.view, services=raykv_services
        )
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
    from raykv.core.factory import TierFactory as F

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


# == every entry point, by class of input ================================================
# Each malformed config is tried through every entry point that takes a config: the
# config dict, raykv.start(...) and raykv_kv_transfer_config(...). All must raise a
# ConfigError naming the same field before anything starts.
def _entry_points():
    import raykv
    from raykv.integrations.vllm import raykv_kv_transfer_config

    return {
        "RaykvConfig.from_dict": RaykvConfig.from_dict,
        "raykv.start": lambda raw: raykv.start(raw, address="ray://nowhere:1"),  # must fail before connecting
        "raykv_kv_transfer_config": raykv_kv_transfer_config,
    }


def _rejected_everywhere(raw, field: str) -> None:
    for entry, call in _entry_points().items():
        with pytest.raises(ConfigError) as e:
            call(raw)
        assert e.value.field == field, (entry, raw, str(e.value))
        assert "\n" not in str(e.value), (entry, str(e.value))


SHAPES = [  # (config tree, field named)
    ([{"namespace": "x"}], "config"),
    ("namespace: x", "config"),
    (42, "config"),
    ({"tiers": {"type": "fs"}}, "tiers"),
    ({"tiers": "object_store"}, "tiers"),
    ({"tiers": ["object_store"]}, "tiers[0]"),
    ({"tiers": [["type", "fs"]]}, "tiers[0]"),
    ({"tiers": [{"root": "/tmp/x"}]}, "tiers[0].type"),
    ({"tiers": [{"type": None}]}, "tiers[0].type"),
    ({"rules": {"tier": "fs"}}, "rules"),
    ({"rules": [["fs"]]}, "rules[0]"),
    ({"rules": [{"tier": "*", "match": ["persist"]}]}, "rules[0].match"),
    ({"rules": [{"tier": "*", "match": {"kv_transfer_params": ["persist"]}}]}, "rules[0].match.kv_transfer_params"),
    ({1: "x"}, "1"),
    ({"tiers": [{"type": "object_store", 2: 3}]}, "tiers[0].2"),
    (
        {"rules": [{"tier": "*", "match": {"kv_transfer_params": {1: "a", "b": 2}}}]},
        "rules[0].match.kv_transfer_params.1",
    ),
]


@pytest.mark.parametrize(("raw", "field"), SHAPES, ids=[f for _, f in SHAPES])
def test_shape(raw, field):
    _rejected_everywhere(raw, field)


TYPES = [
    ({"directory_shards": "4"}, "directory_shards"),
    ({"directory_shards": 4.0}, "directory_shards"),
    ({"directory_shards": True}, "directory_shards"),
    ({"lookup_ttl_s": "2s"}, "lookup_ttl_s"),
    ({"namespace": 7}, "namespace"),
    ({"tiers": [{"type": "fs", "root": 7}]}, "tiers[0].root"),
    ({"tiers": [{"type": "object_store", "capacity_bytes": "4G"}]}, "tiers[0].capacity_bytes"),  # GiB or GB?
    ({"tiers": [{"type": "object_store", "capacity_bytes": [1]}]}, "tiers[0].capacity_bytes"),
    ({"tiers": [{"type": "fs", "root": "/tmp/x", "tenant_quotas": {"a": "lots"}}]}, "tiers[0].tenant_quotas"),
    ({"tiers": [{"type": "fs", "root": "/tmp/x", "fsync": "yes"}]}, "tiers[0].fsync"),
    ({"rules": [{"tier": 5}]}, "rules[0].tier"),
    ({"rules": [{"tier": "fs", "match": {"tenant": 5}}]}, "rules[0].match.tenant"),
    (
        {"rules": [{"tier": "*", "match": {"kv_transfer_params": {"k": object()}}}]},
        "rules[0].match.kv_transfer_params.k",
    ),
]


@pytest.mark.parametrize(("raw", "field"), TYPES, ids=[f for _, f in TYPES])
def test_type(raw, field):
    _rejected_everywhere(raw, field)


def _number_fields():
    """(schema name, field, parse) of every float option and every bounded int option."""
    for name, schema, parse in _schemas():
        for f in dataclasses.fields(schema):
            kind = f.metadata["kind"]
            if kind in (float, int):
                yield name, f, parse


def test_range_nan_inf_and_limits_of_every_number_field():
    checked = 0
    for name, f, parse in _number_fields():
        bad = [float("nan"), float("inf"), float("-inf")] if f.metadata["kind"] is float else []
        if f.metadata.get("max") is not None:
            bad.append(f.metadata["kind"](f.metadata["max"]) * 2 + 1)
        if f.metadata.get("min") is not None:
            bad.append(f.metadata["kind"](f.metadata["min"]) - 1)
        for value in bad:
            with pytest.raises(ConfigError) as e:
                parse({f.name: value})
            assert f.name in e.value.field, (name, f.name, value, str(e.value))
            checked += 1
    # the durations the issue names, through the real entry points
    for raw, field in [
        ({"lookup_ttl_s": float("nan")}, "lookup_ttl_s"),
        ({"policy_refresh_s": float("inf")}, "policy_refresh_s"),
        ({"directory_shards": 10**6}, "directory_shards"),
        ({"tiers": [{"type": "object_store", "job_timeout_s": float("nan")}]}, "tiers[0].job_timeout_s"),
        (
            {"tiers": [{"type": "fs", "root": "/tmp/x", "control_timeout_s": float("nan")}]},
            "tiers[0].control_timeout_s",
        ),
        ({"tiers": [{"type": "fs", "root": "/tmp/x", "io_threads": 10**6}]}, "tiers[0].io_threads"),
    ]:
        _rejected_everywhere(raw, field)
    assert checked > 20


def test_range_dangerous_but_legal_values_warn_once(caplog):
    import logging

    from raykv.core import validate

    validate._warned.discard("lookup_ttl_s>60.0")
    with caplog.at_level(logging.WARNING, logger="raykv.core.validate"):
        for _ in range(3):
            assert RaykvConfig.from_dict({"lookup_ttl_s": 600.0}).lookup_ttl_s == 600.0
    warnings = [r for r in caplog.records if "lookup_ttl_s=600.0" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


DUPLICATES = [
    ({"tiers": [{"type": "object_store"}, {"type": "object_store", "capacity_bytes": 1}]}, "tiers[1]"),
    ({"tiers": [{"type": "fs", "root": "/mnt/kv"}, {"type": "fs", "root": "/mnt/kv"}]}, "tiers[1]"),
    ({"tiers": [{"type": "fs", "root": "/mnt/kv"}, {"type": "fs", "root": "/mnt//kv/"}]}, "tiers[1]"),
    ({"tiers": [{"type": "fs", "root": "/mnt/kv"}, {"type": "fs", "root": "/mnt/x/../kv"}]}, "tiers[1]"),
    ({"tiers": [{"type": "fs", "root": "/mnt/kv"}, {"type": "fs", "root": "//mnt/./kv"}]}, "tiers[1]"),
    ({"tiers": [{"type": "fs", "root": "s3://b/kv"}, {"type": "fs", "root": "S3://b/kv/"}]}, "tiers[1]"),
    ({"rules": [{"tier": "*", "name": "a"}, {"tier": "fs", "name": "a"}]}, "rules[1].name"),
]


@pytest.mark.parametrize(("raw", "field"), DUPLICATES, ids=[str(i) for i in range(len(DUPLICATES))])
def test_duplicates(raw, field):
    _rejected_everywhere(raw, field)


def test_distinct_tiers_are_not_duplicates():
    cfg = RaykvConfig.from_dict(
        {"tiers": [{"type": "object_store"}, {"type": "fs", "root": "/mnt/a"}, {"type": "fs", "root": "/mnt/b"}]}
    )
    assert len(cfg.tiers) == 3


CROSS_FIELD = [
    ({"tiers": [{"type": "object_store"}], "rules": [{"tier": "fs"}]}, "rules[0].tier"),
    ({"rules": [{"tier": "redis"}]}, "rules[0].tier"),
    ({"rules": [{"tier": ""}]}, "rules[0].tier"),
    ({"namespace": "a", "tiers": [{"type": "object_store", "namespace": "b"}]}, "tiers[0].namespace"),
    ({"tiers": [{"type": "fs", "root": "/tmp/x", "namespace": "other"}]}, "tiers[0].namespace"),
    (
        {"rules": [{"tier": "*", "match": {"kv_transfer_params": {"persist": float("nan")}}}]},
        "rules[0].match.kv_transfer_params.persist",
    ),
]


@pytest.mark.parametrize(("raw", "field"), CROSS_FIELD, ids=[f for _, f in CROSS_FIELD])
def test_cross_field(raw, field):
    _rejected_everywhere(raw, field)


def _fs(root: str) -> dict:
    return {"tiers": [{"type": "fs", "root": root}]}


ABSURD = [  # (config tree, field named, words of the message)
    (_fs("/"), "tiers[0].root", "system directory '/'"),
    (_fs("/etc"), "tiers[0].root", "system directory '/etc'"),
    (_fs("/tmp/kv/../../etc"), "tiers[0].root", "system directory '/etc'"),
    (_fs("/mnt/kv/../../etc/raykv"), "tiers[0].root", "inside the system directory '/etc'"),
    (_fs("/proc/self/cwd"), "tiers[0].root", "inside the system directory '/proc'"),
    (_fs("/dev/shm"), "tiers[0].root", "/dev/shm/raykv"),
    (_fs("/tmp/"), "tiers[0].root", "system directory '/tmp'"),
    (_fs("/" + "a" * 5000), "tiers[0].root", "at most 1024 characters; got 5001"),
    (_fs("s3://bucket/" + "p" * 5000), "tiers[0].root", "at most 1024 characters"),
    ({"namespace": "n" * 10_000}, "namespace", "at most 128 characters; got 10000"),
    ({"tiers": [{"type": "object_store", "namespace": "n" * 10_000}]}, "tiers[0].namespace", "at most 128"),
]


@pytest.mark.parametrize(("raw", "field", "words"), ABSURD, ids=[w for _, _, w in ABSURD])
def test_system_directories_and_absurd_lengths(raw, field, words):
    _rejected_everywhere(raw, field)
    with pytest.raises(ConfigError, match=re.escape(words)):
        RaykvConfig.from_dict(raw)


def test_roots_beside_system_directories_are_fine():
    for root in ("/tmp/raykv", "/dev/shm/raykv", "/mnt/kv", "/etcetera/kv", "/home/me/kv", "/" + "a" * 1000):
        RaykvConfig.from_dict(_fs(root))
    import raykv

    with pytest.raises(ConfigError) as e:  # the API's own argument, too
        raykv.attach("n" * 10_000)
    assert e.value.field == "namespace"


def test_cross_field_add_rule_and_fs_root_that_is_a_file(raykv_services, tmp_path):
    """Through a running raykv: a rule for a tier that does not exist, a rule of
    the wrong shape, an fs root that is a regular file. Nothing is registered."""
    import raykv

    version = ray.get(raykv_services.control.rules.remote())[0]
    for rule, field in [
        ({"tier": "redis"}, "rule.tier"),
        ({"tier": ""}, "rule.tier"),
        ([("tier", "fs")], "rule"),
        ("fs", "rule"),
        ({"tier": "fs", "match": {"kv_transfer_params": {1: True, "a": 2}}}, "rule.match.kv_transfer_params.1"),
    ]:
        with pytest.raises(ConfigError) as e:
            raykv_services.add_rule(rule)
        assert e.value.field == field, (rule, str(e.value))
    assert ray.get(raykv_services.control.rules.remote())[0] == version
    with pytest.raises(ConfigError, match="name"):
        raykv_services.remove_rule(3)

    a_file = tmp_path / "not-a-dir"
    a_file.write_bytes(b"x")
    with PrimaryRegion(2, BLOCK) as region:
        with pytest.raises(ConfigError) as e:
            TierFactory.create_tier({"type": "fs", "root": str(a_file)}, region.view, services=raykv_services)
    assert e.value.field == "root" and "not a directory" in str(e.value)
    with pytest.raises(ConfigError) as e:  # through raykv.start, the field as the config names it
        raykv.start({"namespace": raykv_services.namespace, "tiers": [{"type": "fs", "root": str(a_file)}]})
    assert e.value.field == "tiers[0].root" and "not a directory" in str(e.value), str(e.value)
    from tiers.fs.storage import open_storage

    with pytest.raises(NotADirectoryError, match="not a directory"):  # what the root actor itself says
        open_storage(str(a_file)).ensure_root()


def test_cpu_primary_smaller_than_one_block():
    from raykv.integrations.vllm.config import check_primary_fits, kv_transfer_config

    check_primary_fits(1 << 20, 128 << 10, 8)
    with pytest.raises(ConfigError) as e:
        check_primary_fits(4096, 128 << 10, 0)
    assert e.value.field == "cpu_bytes_to_use" and "131072" in str(e.value)
    for bad in (0, -1, 1.5, "4G", "4 apples", "0GiB", True, None, float("nan")):
        with pytest.raises(ConfigError) as e:
            kv_transfer_config(cpu_bytes=bad)
        assert e.value.field == "cpu_bytes"
    # a size, as in config files and the CLI ("4G" above is refused: binary or decimal?)
    assert kv_transfer_config(cpu_bytes="4GiB")["kv_connector_extra_config"]["cpu_bytes_to_use"] == 4 << 30


@pytest.mark.parametrize("tier_type", ["example", "object_store", "fs"])
def test_tier_over_a_primary_of_no_block_names_cpu_bytes(raykv_services, tmp_path, tier_type):
    """A primary of 0 chunks (cpu_bytes below one block under vLLM's own spec, which then
    builds an empty primary): every raykv tier refuses it, naming the field, before it starts."""
    empty = memoryview(np.zeros((0, BLOCK), np.uint8))
    cfg = {"type": tier_type, **({"root": str(tmp_path / "kv")} if tier_type == "fs" else {})}
    with pytest.raises(ConfigError) as e:
        TierFactory.create_tier(cfg, empty, services=raykv_services)
    assert e.value.field == "cpu_bytes_to_use" and f"at least {BLOCK} bytes" in str(e.value), str(e.value)
    assert not (tmp_path / "kv").exists()  # refused before anything started


# -- the client API: arguments are checked, never coerced --------------------------------
def test_api_arguments_are_named_not_coerced(raykv_services):
    from raykv.core.keys import make_offload_key
    from raykv.core.validate import ArgumentError

    good = _keys(2)
    for args, kwargs, field in [
        (("abc", 4), {}, "token_ids"),
        ((b"abcd", 4), {}, "token_ids"),
        (([1.0, 2.0], 1), {}, "token_ids[0]"),
        ((np.zeros(8), 4), {}, "token_ids"),
        ((list(range(8)), 0), {}, "block_size"),
        ((list(range(8)), 2.0), {}, "block_size"),
        ((list(range(8)), "4"), {}, "block_size"),
        ((list(range(8)), 4), {"salt": 5}, "salt"),
        ((list(range(8)), 4), {"group_idx": -1}, "group_idx"),
        ((list(range(8)), 4), {"group_idx": 2**32}, "group_idx"),
    ]:
        with pytest.raises(ArgumentError) as e:
            prefix_keys(*args, **kwargs)
        assert e.value.field == field, (args, kwargs, str(e.value))
    for args, field in [
        (("ab", 0), "block_hash"),
        ((b"", 0), "block_hash"),
        ((b"h", 1.5), "group_idx"),
        ((b"h", -2), "group_idx"),
    ]:
        with pytest.raises(ArgumentError) as e:
            make_offload_key(*args)
        assert e.value.field == field

    directory = raykv_services.directory
    for keys, field in [
        ("abcdefgh", "keys"),
        (good[0], "keys"),
        ([1, 2, 3], "keys[0]"),
        ([good[0], "x" * 40], "keys[1]"),
        ([good[0], b"abc"], "keys[1]"),
        ({good[0]: 1}, "keys"),
        (12345, "keys"),
    ]:
        with pytest.raises(ArgumentError) as e:
            directory.prefix_lookup(keys)
        assert e.value.field == field, (keys, str(e.value))
    with pytest.raises(ArgumentError, match="node_id"):
        directory.prefix_lookup(good, node_id=5)
    with pytest.raises(ArgumentError, match="timeout"):
        directory.lookup(good, timeout=float("nan"))
    assert directory.prefix_lookup(good).num_keys == 0  # good input still works

    with PrimaryRegion(4, BLOCK) as region:
        tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=raykv_services)
        try:
            drv = TierDriver(tier)
            for chunks, field in [
                ([0.0, 1.0], "chunk_ids[0]"),
                (["0", "1"], "chunk_ids[0]"),
                ([True, 1], "chunk_ids[0]"),
                (np.array([0.5, 1.5]), "chunk_ids"),
                ([0, -1], "chunk_ids[1]"),
                ([0, 4], "chunk_ids[1]"),
                ([0], "chunk_ids"),
                ("01", "chunk_ids"),
            ]:
                with pytest.raises(ArgumentError) as e:
                    drv.store(good, chunks)
                assert e.value.field == field, (chunks, str(e.value))
            with pytest.raises(ArgumentError, match="timeout"):
                drv.store(good, [0, 1], timeout=float("inf"))
            # A job whose chunk ids are floats, built by hand, fails as a job (never a slot 0 or 1).
            job = TransferJob(next(_ids), good, np.array([0.7, 1.2]), False, ReqContext("bad"))
            tier.submit_store(job)
            res = drv.wait(job.job_id, 20.0)
            assert not res.success and "chunk ids must be ints" in res.error, res.error
            assert tier.lookup_blocking(good) == [LookupResult.MISS] * 2
        finally:
            tier.shutdown()


# -- files, through the CLI: exit code 2 and one line, never a traceback -------------------
BAD_FILES = {  # file name -> (content, what the message must say)
    "list.yaml": ("- namespace: x\n- tiers: []\n", "top level"),
    "scalar.yaml": ("42\n", "top level"),
    "string.json": ('"raykv"', "top level"),
    "syntax.yaml": ("namespace: [raykv\ntiers: {\n", "invalid YAML at line"),
    "tabs.yaml": ("namespace: raykv\n\ttiers: []\n", "invalid YAML"),
    "syntax.json": ('{"namespace": "raykv",}', "invalid JSON at line 1"),
    "nan.json": ('{"lookup_ttl_s": NaN}', "NaN"),
    "duplicate-key.yaml": ("namespace: a\nnamespace: b\n", "appears twice"),
    "duplicate-key.json": ('{"namespace": "a", "namespace": "b"}', "appears twice"),
    "binary.yaml": (b"\xff\xfe\x00\x01", "not UTF-8"),
    "mixed-keys.yaml": ("rules:\n  - {tier: '*', match: {kv_transfer_params: {1: a, b: 2}}}\n", "keys must be strings"),
    "nan.yaml": ("lookup_ttl_s: .nan\n", "lookup_ttl_s: must be a finite number"),
    "inf.yaml": ("tiers:\n  - {type: object_store, job_timeout_s: .inf}\n", "tiers[0].job_timeout_s"),
    "unknown-tier.yaml": ("tiers:\n  - {type: redis}\n", "tiers[0].type: unknown tier type 'redis'"),
    "same-root.yaml": (
        "tiers:\n  - {type: fs, root: /mnt/kv}\n  - {type: fs, root: /mnt/kv/}\n",
        "duplicate of tiers[0]",
    ),
    "rule-tier.yaml": ("tiers:\n  - {type: object_store}\nrules:\n  - {tier: fs}\n", "rules[0].tier"),
    "namespace.yaml": ("namespace: a\ntiers:\n  - {type: object_store, namespace: b}\n", "tiers[0].namespace"),
    "key-unhashable.yaml": ("? [a, b]\n: 1\n", "key must be a scalar"),
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-configs")
    for name, (content, _) in BAD_FILES.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (d / "a-directory.yaml").mkdir()
    return d


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from raykv.ops.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.err


@pytest.mark.parametrize("command", ["vllm-config", "start"])
def test_cli_on_malformed_files(bad_files, capsys, command):
    cases = {
        **{n: m for n, (_, m) in BAD_FILES.items()},
        "a-directory.yaml": "is a directory",
        "missing.yaml": "no such file",
    }
    for name, expected in cases.items():
        rc, err = _cli(
            capsys,
            command,
            "--config",
            str(bad_files / name),
            *(["--address", "ray://nowhere:1"] if command == "start" else []),
        )
        lines = err.strip().splitlines()
        assert rc == 2, (name, rc, err)
        assert len(lines) == 1 and lines[0].startswith("raykv: error: "), (name, err)
        assert expected in lines[0], (name, lines[0])
        assert "Traceback" not in err
    rc, err = _cli(capsys, command, "--config", str(bad_files / "nan.yaml"), "--namespace", "bad namespace!")
    assert rc == 2 and err.count("\n") == 1 and "namespace" in err, err


def test_cli_process_exit_code_and_one_line(bad_files):
    """The real command in its own process (what a shell sees)."""
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
        ),
    }
    env.pop("RAYKV_DEBUG", None)
    for argv in (
        ["vllm-config", "--config", str(bad_files / "syntax.yaml")],
        ["start", "--config", str(bad_files / "list.yaml")],
        ["status", "--namespace", "no/such ns", "--address", "127.0.0.1:1"],
    ):
        p = subprocess.run(
            [sys.executable, "-m", "raykv.ops.cli", *argv], capture_output=True, text=True, env=env, timeout=120
        )
        assert p.returncode == 2, (argv, p.returncode, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("raykv: error: ") and "Traceback" not in p.stderr, (
            argv,
            p.stderr,
        )


# -- constructors that fail: a readable repr, and no restart loop --------------------------
def _actor_classes() -> dict[str, type]:
    """Every raykv actor class (the Python class under each ``@ray.remote``), plus the
    vLLM engine replica (made an actor at run time)."""
    import importlib
    import pkgutil

    import raykv
    import tiers
    from raykv.demo.replicas import EngineReplica

    found: dict[str, type] = {"EngineReplica": EngineReplica}
    for pkg in (raykv, tiers):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if ".bench" in mod.name or mod.name.endswith((".tiers", ".spec", ".cpu_worker")):
                continue  # benchmarks' local actors; modules that import vLLM at import time
            module = importlib.import_module(mod.name)
            for value in vars(module).values():
                cls = getattr(value, "__ray_actor_class__", None)
                if isinstance(cls, type) and cls.__module__ == module.__name__:
                    found[cls.__name__] = cls
    return found


def _failing_inits(tmp_path) -> dict[str, tuple]:
    """Arguments that make each actor class's ``__init__`` raise (outside Ray)."""
    return {
        "ControlActor": (RaykvConfig(directory_shards=2, rules=[{"tier": 5}]),),
        "DirectoryShard": (0, 2, "raykv-test"),  # no running event loop here
        "DirectoryAgent": ("raykv-test", "node-x", [], 2.0, 1024),  # no running event loop here
        "FsRootActor": (FsRootSettings(str(tmp_path / "no-such-parent" / "root"), 0), "raykv-test"),
        "ObjectStoreActor": ("node-x", "raykv-test", ObjectStoreSettings()),  # no running event loop here
        "ExampleNodeActor": ("node-x", "raykv-test", 0),  # no running event loop here
        "EngineCacheActor": (  # no running event loop here either
            HolderInfo("engine:x:1", "engine", "engine", "e", "n"),
            "raykv-test",
        ),
        "PendingActor": (  # no running event loop here either
            HolderInfo("pending:x:1", "pending", "pending", "p", "n"),
            "raykv-test",
        ),
        "EngineReplica": ("", None, {}),
    }


def test_every_actor_repr_works_on_a_half_built_instance(tmp_path):
    classes = _actor_classes()
    inits = _failing_inits(tmp_path)
    assert set(classes) == set(inits), f"new actor class? give it failing init args: {set(classes) ^ set(inits)}"
    for name, cls in classes.items():
        bare = cls.__new__(cls)  # __init__ raised on its first line
        assert isinstance(repr(bare), str) and repr(bare)
        obj = cls.__new__(cls)
        # each class fails its own way; what is checked is the repr afterwards
        with pytest.raises(Exception):  # noqa: B017
            cls.__init__(obj, *inits[name])
        text = repr(obj)
        assert text and "\n" not in text, (name, text)
        print(f"{name}: {repr(bare)} / {text}")
    assert repr(classes["FsRootActor"].__new__(classes["FsRootActor"])).startswith("FsRoot(")


@pytest.fixture(scope="module")
def ray_local(free_port):
    """conftest's local Ray, here with Ray's dashboard: it serves Ray's state API
    (``ray.util.state``), which shows dead actors and their restarts."""
    dashboard = {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()}
    start_local_ray(num_cpus=4, object_store_memory=512 << 20, **dashboard)
    yield
    ray.shutdown()


def test_uncreatable_fs_root_fails_once_and_is_not_restarted(raykv_services, tmp_path):
    """The root's parent does not exist: one clear error, and the root actor stays
    dead (it used to crash-loop under max_restarts=-1, its repr raising)."""
    from ray.util.state import list_actors
    from ray.util.state.common import ActorState

    from raykv.core import naming
    from raykv.core.errors import RaykvError

    root = str(tmp_path / "not-mounted" / "kv")
    t0 = time.monotonic()
    with PrimaryRegion(2, BLOCK) as region:
        with pytest.raises(RaykvError) as e:
            TierFactory.create_tier({"type": "fs", "root": root}, region.view, services=raykv_services)
    msg = str(e.value)
    assert "\n" not in msg and "does not exist" in msg and "not-mounted" in msg, msg
    name = naming.fs_actor(root)

    def mine() -> list[ActorState]:  # every actor of that name, dead ones too (any namespace)
        return list_actors(ray.get_runtime_context().gcs_address, filters=[("name", "=", name)], detail=True)

    # DEAD is final in Ray; a crash loop would show restarts (or a re-created actor)
    # within seconds, so a 10 s watch is enough to catch one.
    while True:
        actors = mine()
        assert len(actors) == 1, actors  # never re-created
        assert actors[0].state == "DEAD" and actors[0].num_restarts == 0, actors[0]
        if time.monotonic() - t0 > 10:
            break
        time.sleep(1)  # not a wait: the actor must stay DEAD while 10 s pass (no crash loop)
