"""The fs tier on a real local Ray: round trips, eviction, failures, actor death."""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
import threading
import time

import numpy as np
import pytest
import ray

from raykv.core import naming
from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.jobs import failure_reason
from raykv.core.keys import prefix_keys
from raykv.core.pins import Unpin
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.waiting import wait_until
from tiers.fs import format as fmt
from tiers.fs.actor import holder_info

BLOCK = 64 * 1024
FILE = fmt.header_size(len(scoped_keys([bytes(36)])[0])) + BLOCK  # on-disk size of one block file
_ids = itertools.count(1)
_seeds = itertools.count(1)


_open_tiers: list = []


def _tier(services, root, view, **options):
    tier = TierFactory.create_tier({"type": "fs", "root": str(root), **options}, view, services=services)
    _open_tiers.append(tier)
    return tier


@pytest.fixture(autouse=True)
def _shutdown_tiers():
    """Tiers a test leaves open (it failed half-way) are shut down with it."""
    yield
    while _open_tiers:
        _open_tiers.pop().shutdown()


def _keys(n):
    """``n`` keys never used before in this module."""
    base = next(_seeds) * 100_000
    return prefix_keys(list(range(base, base + 10 * n)), 10)


def _fill(region, seed=0):
    region.array[:] = np.random.default_rng(seed).integers(0, 256, region.array.shape, dtype=np.uint8)


def _held(services, keys):
    """Which keys the directory lists (fresh, bypassing the lookup cache)."""
    return [bool(h) for h in services.directory.lookup(scoped_keys(keys))]


def _disk_bytes(root):
    total = 0
    for dirpath, _, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def _path(root, key):
    return os.path.join(str(root), fmt.rel_path(scoped_keys([key])[0]))


def _run_jobs(tier, jobs, timeout=30.0):
    """Submit (kind, keys, chunks) jobs at once; every one must end in exactly one result."""
    submitted = []
    for kind, keys, chunks in jobs:
        job = TransferJob(next(_ids), list(keys), np.asarray(chunks, dtype=np.int64), kind == "load", ReqContext("t"))
        (tier.submit_load if kind == "load" else tier.submit_store)(job)
        submitted.append(job.job_id)
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(submitted):
        for r in tier.get_finished_jobs():
            assert r.job_id not in results, f"job {r.job_id} reported twice"
            results[r.job_id] = r
        assert time.monotonic() < deadline, "a job never reported: hang"
        tier.on_schedule_end()
        time.sleep(0.001)
    time.sleep(0.05)
    assert list(tier.get_finished_jobs()) == []  # nothing extra afterwards
    return [results[j] for j in submitted]


# -- 1. round trip --------------------------------------------------------------
@pytest.mark.parametrize("uri", [False, True], ids=["path", "file-uri"])
def test_store_lookup_load_roundtrip(raykv_services, tmp_path, uri):
    root = f"file://{tmp_path}/kv" if uri else str(tmp_path / "kv")
    keys = _keys(6)
    with PrimaryRegion(8, BLOCK) as src, PrimaryRegion(8, BLOCK) as dst:
        _fill(src, 1)
        writer = _tier(raykv_services, root, src.view)
        res = TierDriver(writer).store(keys, [0, 1, 2, 3, 4, 5])
        assert res.success, res.error
        assert res.transfer_bytes == 6 * BLOCK

        raykv_services.lookup_cache.invalidate(scoped_keys(keys))  # make the reader ask the directory
        reader = _tier(raykv_services, root, dst.view)
        others = _keys(2)
        assert reader.lookup_blocking(keys + others) == [LookupResult.HIT] * 6 + [LookupResult.MISS] * 2
        res = TierDriver(reader).load(keys, [7, 6, 5, 4, 3, 2])
        assert res.success, res.error
        for s, d in zip(range(6), [7, 6, 5, 4, 3, 2]):
            assert np.array_equal(src.array[s], dst.array[d])

        # files and directories are owner-only, named by the key's hex
        f = _path(tmp_path / "kv", keys[0])
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(f)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.dirname(os.path.dirname(f))).st_mode) == 0o700
        assert os.path.getsize(f) == FILE
        assert not [n for _, _, fs in os.walk(tmp_path) for n in fs if n.endswith(".tmp")]

        # storing again skips present files but still succeeds
        before = os.stat(f).st_mtime_ns
        assert TierDriver(writer).store(keys[:2], [0, 1]).success
        assert os.stat(f).st_mtime_ns == before
        stats = ray.get(writer.actor.stats.remote()).figures
        assert stats["files"] == 6 and stats["bytes"] == 6 * FILE
        assert writer.stats().figures == stats  # the tier's own stats(): the root actor's
        text = ray.get(writer.actor.__ray_call__.remote(lambda self: repr(self)))
        assert text.startswith(f"FsRoot({writer.root}, capacity ") and "files=" not in text, text
        writer.shutdown()
        reader.shutdown()


def test_restarted_root_actor_rescans(raykv_services, tmp_path):
    root = str(tmp_path / "kv")
    keys = _keys(4)
    with PrimaryRegion(4, BLOCK) as src, PrimaryRegion(4, BLOCK) as dst:
        _fill(src, 2)
        tier = _tier(raykv_services, root, src.view)
        assert TierDriver(tier).store(keys, [0, 1, 2, 3]).success
        tier.shutdown()
        ray.kill(tier.actor)
        t0 = time.monotonic()
        while any(_held(raykv_services, keys)):
            assert time.monotonic() - t0 < 5
            time.sleep(0.01)
        # a new root actor finds the files and registers them: nothing lost
        again = _tier(raykv_services, root, dst.view)
        assert _held(raykv_services, keys) == [True] * 4
        assert ray.get(again.actor.stats.remote()).figures["scanned_at_start"] == 4
        assert TierDriver(again).load(keys, [3, 2, 1, 0]).success
        assert np.array_equal(src.array[::-1], dst.array)
        again.shutdown()


# -- 3. eviction -----------------------------------------------------------------
def test_capacity_evicts_lru(raykv_services, tmp_path):
    root = tmp_path / "kv"
    cap = 5 * FILE
    keys = _keys(12)
    with PrimaryRegion(8, BLOCK) as src:
        _fill(src, 3)
        tier = _tier(raykv_services, root, src.view, capacity_bytes=cap)
        drv = TierDriver(tier)
        assert drv.store(keys[:4], [0, 1, 2, 3]).success
        tier.touch([keys[0]], drv.req)  # key 0 becomes most recently used
        assert drv.store(keys[4:6], [4, 5]).success  # 6 files > 5: evicts key 1
        assert _held(raykv_services, keys[:6]) == [True, False, True, True, True, True]
        assert not os.path.exists(_path(root, keys[1]))
        assert _disk_bytes(root) <= cap

        for i in range(6, 12, 3):  # more jobs; capacity holds after each
            assert drv.store(keys[i : i + 3], [0, 1, 2]).success
            assert _disk_bytes(root) <= cap
        held = _held(raykv_services, keys)
        assert sum(held) == 5 and held[-5:] == [True] * 5
        files = {n for _, _, fs in os.walk(root) for n in fs}
        assert files == {fmt.file_name(k) for k in scoped_keys(keys[-5:])}
        assert tier.lookup_blocking(keys[:2]) == [LookupResult.MISS] * 2  # evicted: MISS here too

        # one job larger than the capacity: succeeds, keeps only what fits
        big = _keys(7)
        assert drv.store(big, list(range(7))).success
        assert _held(raykv_services, big) == [False, False] + [True] * 5
        assert _disk_bytes(root) <= cap
        stats = ray.get(tier.actor.stats.remote()).figures
        assert stats["bytes"] <= cap and stats["evicted"] >= 9
        tier.shutdown()


def test_capacity_and_quotas_as_sizes(raykv_services, tmp_path):
    """Options in bytes written as a user writes them ('1MiB') hold on disk, as ints do."""
    root = tmp_path / "kv"
    keys = _keys(24)
    with PrimaryRegion(24, BLOCK) as src:
        _fill(src, 5)
        tier = _tier(raykv_services, root, src.view, capacity_bytes="1MiB", tenant_quotas={"*": "512 KiB"})
        drv = TierDriver(tier)
        for i in range(0, 24, 4):  # 24 blocks of 64 KiB and more: 1.5 MiB on disk without the caps
            assert drv.store(keys[i : i + 4], [i, i + 1, i + 2, i + 3]).success
        figures = ray.get(tier.actor.stats.remote()).figures
        assert figures["capacity_bytes"] == 1 << 20
        assert 0 < _disk_bytes(root) <= 512 << 10  # every block here is one tenant's: its quota binds
        assert sum(_held(raykv_services, keys)) == (512 << 10) // FILE
        tier.shutdown()


# -- 4. exactly one result per job, whatever fails -----------------------------------
def test_missing_evicted_and_partial_loads(raykv_services, tmp_path):
    root = tmp_path / "kv"
    keys = _keys(8)
    with PrimaryRegion(8, BLOCK) as src, PrimaryRegion(8, BLOCK) as dst:
        _fill(src, 4)
        tier = _tier(raykv_services, root, src.view, capacity_bytes=3 * FILE)
        reader = _tier(raykv_services, root, dst.view)
        assert TierDriver(tier).store(keys[:3], [0, 1, 2]).success
        assert TierDriver(tier).store(keys[3:5], [3, 4]).success  # evicts keys 0 and 1
        never = _keys(2)
        results = _run_jobs(
            reader,
            [
                ("load", never, [0, 1]),  # never stored
                ("load", keys[:2], [2, 3]),  # evicted
                ("load", [keys[2], never[0], keys[3], keys[0], keys[4]], [0, 1, 2, 3, 4]),  # partial
                ("load", keys[2:5], [5, 6, 7]),  # all there
                ("load", [], []),  # empty job
            ],
        )
        missing, evicted, partial, full, empty = results
        assert not missing.success and not missing.successful_keys and "missing" in missing.error
        assert not evicted.success and not evicted.successful_keys
        assert not partial.success and list(partial.successful_keys) == [keys[2], keys[3], keys[4]]
        assert "2 of 5 keys not loaded" in partial.error
        assert full.success and empty.success
        for s, d in [(2, 0), (3, 2), (4, 4), (2, 5), (3, 6), (4, 7)]:
            assert np.array_equal(src.array[s], dst.array[d])
        assert reader.lookup_blocking(never + keys[:2]) == [LookupResult.MISS] * 4

        # mismatched keys/chunks, out-of-range chunk: failed results, not exceptions
        bad = _run_jobs(reader, [("load", keys[2:4], [0]), ("load", keys[2:3], [99]), ("store", keys[5:6], [-1])])
        assert [r.success for r in bad] == [False] * 3
        assert "chunk id 99" in bad[1].error

        # drain waits for in-flight I/O; jobs submitted after shutdown still report
        for i in range(20):
            tier.submit_store(TransferJob(next(_ids), [keys[i % 8]], np.array([i % 8]), False, ReqContext("d")))
        tier.drain_jobs()
        assert tier.jobs.num_pending == 0 and len(list(tier.get_finished_jobs())) == 20
        tier.shutdown()
        late = TransferJob(next(_ids), keys[:1], np.array([0]), False, ReqContext("late"))
        tier.submit_store(late)
        [r] = list(tier.get_finished_jobs())
        assert r.job_id == late.job_id and not r.success and "shut down" in r.error
        reader.shutdown()


def test_io_errors_root_replaced_or_removed(raykv_services, tmp_path):
    root = tmp_path / "kv"
    keys = _keys(4)
    with PrimaryRegion(4, BLOCK) as src:
        _fill(src, 5)
        tier = _tier(raykv_services, root, src.view)
        assert TierDriver(tier).store(keys[:2], [0, 1]).success
        # the shared mount goes away and something else sits at its path
        shutil.move(str(root), str(tmp_path / "moved"))
        root.write_bytes(b"not a directory")
        t0 = time.monotonic()
        store, load = _run_jobs(tier, [("store", keys[2:4], [2, 3]), ("load", keys[:2], [2, 3])])
        assert time.monotonic() - t0 < 5
        assert not store.success and "ENOTDIR" in store.error
        assert not load.success and not load.successful_keys and "ENOTDIR" in load.error
        # I/O errors do not drop the keys from the directory (the data may come back)
        assert _held(raykv_services, keys[:2]) == [True, True]
        root.unlink()
        shutil.move(str(tmp_path / "moved"), str(root))
        assert TierDriver(tier).load(keys[:2], [2, 3]).success

        # the root is deleted outright: stores fail (it is not recreated), loads miss
        shutil.rmtree(root)
        store, load = _run_jobs(tier, [("store", keys[2:4], [2, 3]), ("load", keys[:2], [2, 3])])
        assert not store.success and "ENOENT" in store.error
        assert not load.success and "missing" in load.error
        assert _held(raykv_services, keys) == [False] * 4  # the actor confirmed: gone
        assert not root.exists()
        tier.shutdown()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    size = 4 * FILE + 16 * 4096  # room for ~4 block files plus the fan-out dirs
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_io_errors_disk_full(raykv_services, tiny_tmpfs):
    root = tiny_tmpfs / "kv"
    keys = _keys(8)
    with PrimaryRegion(8, BLOCK) as src, PrimaryRegion(8, BLOCK) as dst:
        _fill(src, 6)
        tier = _tier(raykv_services, root, src.view, io_threads=2)
        [res] = _run_jobs(tier, [("store", keys, list(range(8)))])
        assert not res.success and "ENOSPC" in res.error
        stored = list(res.successful_keys)
        assert 1 <= len(stored) < 8
        assert not [n for _, _, fs in os.walk(root) for n in fs if n.endswith(".tmp")]  # no debris
        assert _held(raykv_services, keys) == [k in stored for k in keys]
        res = TierDriver(tier).load(keys, list(range(8)))
        assert list(res.successful_keys) == stored
        reader = _tier(raykv_services, root, dst.view)  # what was stored loads back intact
        assert TierDriver(reader).load(stored, list(range(len(stored)))).success
        for i, k in enumerate(stored):
            assert np.array_equal(dst.array[i], src.array[keys.index(k)])
        tier.shutdown()
        reader.shutdown()


# -- 5. corruption -------------------------------------------------------------------
def test_corrupt_and_truncated_files_fail_and_are_removed(raykv_services, tmp_path):
    root = tmp_path / "kv"
    keys = _keys(5)
    with PrimaryRegion(5, BLOCK) as src, PrimaryRegion(5, BLOCK) as dst:
        _fill(src, 7)
        tier = _tier(raykv_services, root, src.view)
        assert TierDriver(tier).store(keys, list(range(5))).success
        flipped, truncated, foreign = (_path(root, k) for k in keys[:3])
        with open(flipped, "r+b") as f:  # one flipped payload byte
            f.seek(fmt.header_size(len(scoped_keys([keys[0]])[0])) + 1234)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x01]))
        os.truncate(truncated, os.path.getsize(truncated) - 100)
        shutil.copy(_path(root, keys[4]), foreign)  # a valid file under another key's name

        reader = _tier(raykv_services, root, dst.view)
        res = TierDriver(reader).load(keys, list(range(5)))
        assert not res.success
        assert list(res.successful_keys) == keys[3:]
        assert "checksum" in res.error and "truncated" in res.error and "another key" in res.error
        # removed before the failure was reported: files gone, directory updated
        assert not any(os.path.exists(p) for p in (flipped, truncated, foreign))
        assert _held(raykv_services, keys) == [False, False, False, True, True]
        assert reader.lookup_blocking(keys) == [LookupResult.MISS] * 3 + [LookupResult.HIT] * 2
        assert np.array_equal(src.array[3:], dst.array[3:])
        stats = ray.get(tier.actor.stats.remote()).figures
        assert stats["files"] == 2 and stats["removed_reasons"] == {"corrupt": 3}
        # the keys can be stored again
        assert TierDriver(tier).store(keys[:3], [0, 1, 2]).success
        assert TierDriver(reader).load(keys[:3], [0, 1, 2]).success
        assert np.array_equal(src.array[:3], dst.array[:3])

        # a file checksummed with an algorithm this node lacks is not corrupt: it stays
        alien = _path(root, keys[3])
        with open(alien, "r+b") as f:
            head = bytearray(f.read(fmt.header_size(len(scoped_keys([keys[0]])[0]))))
            head[6] = 99  # unknown algorithm id, header checksum made valid again
            head[12:16] = fmt._header_crc(head, scoped_keys([keys[3]])[0]).to_bytes(4, "little")
            f.seek(0)
            f.write(head)
        res = TierDriver(reader).load(keys[3:5], [3, 4])
        assert list(res.successful_keys) == [keys[4]] and "not available on this node" in res.error
        assert os.path.exists(alien) and _held(raykv_services, keys[3:4]) == [True]
        tier.shutdown()
        reader.shutdown()


def test_longest_valid_key_is_stored_and_loaded(raykv_services, tmp_path):
    """A 256-byte offload key (the longest raykv.core.keys accepts) is 264 bytes with its identity
    tag: its block file holds it, it loads back byte-exact, and a root rescan finds it."""
    from raykv.core.keys import MAX_KEY_BYTES, make_offload_key

    root = tmp_path / "kv-long-keys"
    keys = [make_offload_key(bytes([i]) * (MAX_KEY_BYTES - 4), 0) for i in (1, 2)]
    assert [len(k) for k in keys] == [256, 256] and len(scoped_keys(keys)[0]) == 264
    with PrimaryRegion(4, BLOCK) as region:
        _fill(region, 5)
        region.array[2:] = 0
        tier = _tier(raykv_services, root, region.view, fsync=False)
        res = TierDriver(tier).store(keys, [0, 1])
        assert res.success, res.error
        assert all(os.path.exists(_path(root, k)) for k in keys)
        assert tier.lookup_blocking(keys) == [LookupResult.HIT] * 2
        assert TierDriver(tier).load(keys, [2, 3]).success
        assert np.array_equal(region.array[:2], region.array[2:4])
        found = {e.key for e in tier.storage.scan()}
        assert set(scoped_keys(keys)) <= found
        tier.shutdown()


def _actor_log_lines(needle: str) -> list[str]:
    """Lines naming ``needle`` in this Ray session's worker logs (the actors' stderr/stdout)."""
    from pathlib import Path

    ctx = ray.get_runtime_context()  # the session dir is <temp dir>/<session name>
    logs = Path(ctx.get_temp_dir(), ctx.get_session_name(), "logs")
    out = []
    for f in logs.glob("worker-*"):
        try:
            out += [line for line in f.read_text(errors="replace").splitlines() if needle in line]
        except OSError:
            pass
    return out


def test_every_removed_corrupt_file_is_counted_and_named_in_the_log(raykv_services, tmp_path):
    """Seven files corrupted at once, loaded in one job: the root actor counts seven removals
    and its log names each file's key and path (at once, or in the period's summary)."""
    root = tmp_path / "kv-incidents"
    keys = _keys(7)
    with PrimaryRegion(7, BLOCK) as src:
        _fill(src, 11)
        tier = _tier(raykv_services, root, src.view, fsync=False)
        assert TierDriver(tier).store(keys, list(range(7))).success
        paths = [_path(root, k) for k in keys]
        for p in paths:
            with open(p, "r+b") as f:
                f.seek(-8, os.SEEK_END)
                f.write(b"\xff" * 8)
        res = TierDriver(tier).load(keys, list(range(7)))
        assert not res.success and not res.successful_keys
        assert not any(os.path.exists(p) for p in paths)
        stats = ray.get(tier.actor.stats.remote()).figures
        assert stats["removed_reasons"] == {"corrupt": 7} and stats["removed_files_logged"] == {"corrupt": 7}
        scoped = scoped_keys(keys)
        deadline = time.monotonic() + 30  # the first 10 at once; a summary would follow within 10 s
        while True:
            lines = _actor_log_lines(str(root))
            named = [sum(k.hex() in line and p in line for line in lines) for k, p in zip(scoped, paths)]
            if named == [1] * 7 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert named == [1] * 7, lines  # each file once, with its key and its path
        assert all("corrupt" in line for line in lines), lines
        tier.shutdown()


# -- 6. root actor death ---------------------------------------------------------------
def test_killed_root_actor_drops_entries_fast(raykv_services, tmp_path):
    root = tmp_path / "kv"
    keys = _keys(40)
    with PrimaryRegion(40, BLOCK) as src:
        _fill(src, 8)
        tier = _tier(raykv_services, root, src.view, control_timeout_s=5.0)
        assert TierDriver(tier).store(keys, list(range(40))).success
        assert all(_held(raykv_services, keys))
        assert tier.lookup_blocking(keys[:1]) == [LookupResult.HIT]
        actor = ray.get_actor(naming.fs_actor(str(root)), namespace=raykv_services.namespace)
        ray.kill(actor)
        t0 = time.monotonic()
        while any(_held(raykv_services, keys)):
            assert time.monotonic() - t0 < 1.0, "entries of a dead fs root outlived 1 s"
            time.sleep(0.01)
        print(f"fs root entries dropped {1000 * (time.monotonic() - t0):.0f} ms after the kill")
        # the tier's own watch notices too: even the process's cached answers
        # (from our own stores) no longer HIT
        while tier.lookup_blocking(keys) != [LookupResult.MISS] * 40:
            assert time.monotonic() - t0 < 2.0, "cached answers of a dead fs root still HIT"
            time.sleep(0.01)
        t0 = time.monotonic()
        store, load = _run_jobs(tier, [("store", _keys(2), [0, 1]), ("load", keys[:2], [2, 3])], timeout=15)
        assert time.monotonic() - t0 < 10
        assert not store.success and "not committed" in store.error
        assert load.success  # the files are still there and valid
        tier.drain_jobs()
        h = holder_info(str(root), raykv_services.namespace)
        assert all(h.holder_id not in s.holders for s in raykv_services.directory.stats())
        tier.shutdown()


def test_crashed_root_actor_restarts_and_rescans(raykv_services, tmp_path):
    root = tmp_path / "kv"
    keys = _keys(6)
    with PrimaryRegion(6, BLOCK) as src:
        _fill(src, 9)
        tier = _tier(raykv_services, root, src.view)
        assert TierDriver(tier).store(keys, list(range(6))).success
        ray.kill(tier.actor, no_restart=False)  # a crash: Ray restarts it (max_restarts=-1)
        t0 = time.monotonic()
        while True:  # a fresh instance (no commits yet) that found the 6 files
            try:
                stats = ray.get(tier.actor.stats.remote(), timeout=5).figures
                if stats["commits"] == 0 and stats["scanned_at_start"] == 6:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.monotonic() - t0 < 30, "root actor did not restart"
            time.sleep(0.05)
        assert _held(raykv_services, keys) == [True] * 6  # re-registered
        while not tier.holder_alive:  # the tier follows the restart
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)

        def all_hit() -> bool:  # a lookup slower than the cache's max wait (a loaded host) is a MISS: ask again
            raykv_services.lookup_cache.invalidate(scoped_keys(keys))
            return tier.lookup_blocking(keys) == [LookupResult.HIT] * 6

        wait_until(all_hit, timeout_s=30, what="the restarted root's blocks to be found (HIT)")
        more = _keys(2)
        assert TierDriver(tier).store(more, [0, 1]).success
        assert ray.get(tier.actor.stats.remote()).figures["files"] == 8
        tier.shutdown()


@pytest.mark.parametrize("uri", [False, True], ids=["path", "file-uri"])
def test_stores_go_through_the_writers_temp_folder(raykv_services, tmp_path, uri):
    """A store writes its temp file in the writer's own folder under ``.tmp``, never among
    the blocks: a killed writer's leftovers are found there without listing every block."""
    root = tmp_path / "kv"
    keys = _keys(4)
    with PrimaryRegion(4, BLOCK) as src:
        _fill(src, 11)
        tier = _tier(raykv_services, f"file://{root}" if uri else root, src.view)
        assert TierDriver(tier).store(keys, [0, 1, 2, 3]).success
        writers = os.listdir(root / fmt.TMP_DIR)
        assert writers == [os.path.basename(tier.storage.tmp_dir)]
        assert os.listdir(tier.storage.tmp_dir) == []  # renamed into place, nothing left
        assert stat.S_IMODE(os.stat(tier.storage.tmp_dir).st_mode) == 0o700
        names = {n for d, _, fs in os.walk(root) for n in fs}
        assert names == {fmt.file_name(k) for k in scoped_keys(keys)}
        shutil.rmtree(root / fmt.TMP_DIR)  # swept while this writer was idle: it makes its folder again
        more = _keys(2)
        assert TierDriver(tier).store(more, [0, 1]).success
        assert _held(raykv_services, more) == [True, True]
        tier.shutdown()


@pytest.mark.parametrize("uri", [False, True], ids=["path", "file-uri"])
def test_stale_temp_files_are_swept_while_the_actor_runs(raykv_services, tmp_path, uri):
    """Temp files of writers killed mid-store go within about 1.25x ``tmp_max_age_s`` of the
    store, with the actor running (not only when it restarts); younger ones stay."""
    from tiers.fs.actor import start_root_actor
    from tiers.fs.messages import FsRootSettings
    from tiers.fs.storage import canonical_root

    root = tmp_path / "kv"
    root.mkdir()
    now = time.time()
    dead, live, gone = (root / fmt.TMP_DIR / w for w in ("dead0000dead0000", "live0000live0000", "gone0000gone0000"))
    for d in (dead, live, gone):
        d.mkdir(parents=True)
    stale = [dead / f".{i:02x}.kv.0123456789abcdef{fmt.TMP_SUFFIX}" for i in range(3)]
    for p in stale:
        p.write_bytes(b"x" * 4096)
        os.utime(p, (now - 100, now - 100))
    fresh = live / f".ff.kv.0123456789abcdef{fmt.TMP_SUFFIX}"
    fresh.write_bytes(b"y")
    os.utime(fresh, (now + 3600, now + 3600))  # still being written, as far as any age goes
    os.utime(gone, (now - 100, now - 100))  # an empty folder of a writer gone long ago
    settings = FsRootSettings(canonical_root(f"file://{root}" if uri else str(root)), tmp_max_age_s=2.0)
    actor = start_root_actor(settings, raykv_services.namespace)
    try:
        wait_until(lambda: not any(p.exists() for p in stale), timeout_s=30, what="stale temp files swept")
        wait_until(lambda: not gone.exists(), timeout_s=30, what="the empty old writer folder removed")
        assert fresh.exists() and live.exists()
        figures = ray.get(actor.stats.remote()).figures
        assert figures["removed_reasons"]["stale_tmp"] == 3  # by the start-up scan or the sweeps
        assert figures["removed_files_logged"]["stale_tmp"] == 3
        assert figures["files"] == 0  # temp files are never blocks
    finally:
        ray.kill(actor)


def test_root_without_parent_fails_clearly(raykv_services, tmp_path):
    from raykv.core.errors import RaykvError

    with PrimaryRegion(1, BLOCK) as src:
        with pytest.raises(RaykvError, match="mounted"):
            _tier(raykv_services, tmp_path / "not-mounted" / "kv", src.view)


def test_unknown_file_on_disk_is_adopted_by_a_store(raykv_services, tmp_path):
    """A valid file the root actor does not index (its writer's commit never
    arrived) is not rewritten: the store verifies it exists and commits it."""
    from tiers.fs.storage import LocalStorage

    root = tmp_path / "kv"
    keys = _keys(2)
    with PrimaryRegion(2, BLOCK) as src, PrimaryRegion(2, BLOCK) as dst:
        _fill(src, 10)
        tier = _tier(raykv_services, root, src.view)
        LocalStorage(str(root)).store(scoped_keys([keys[0]])[0], memoryview(src.array[0]), fsync=False)
        before = os.stat(_path(root, keys[0])).st_mtime_ns
        assert _held(raykv_services, keys) == [False, False]
        assert TierDriver(tier).store(keys, [0, 1]).success
        assert os.stat(_path(root, keys[0])).st_mtime_ns == before  # not rewritten
        assert _held(raykv_services, keys) == [True, True]
        assert ray.get(tier.actor.stats.remote()).figures["files"] == 2
        reader = _tier(raykv_services, root, dst.view)
        assert TierDriver(reader).load(keys, [0, 1]).success
        assert np.array_equal(src.array, dst.array)
        tier.shutdown()
        reader.shutdown()


# -- pins (kv_transfer_params["cache_ttl_s"]) ----------------------------------------
def test_pins_survive_a_flood_are_capped_unpin_and_go_with_their_identity(raykv_services, tmp_path):
    root = tmp_path / "kv"
    with PrimaryRegion(8, BLOCK) as src:
        _fill(src, 9)
        tier = _tier(raykv_services, root, src.view, capacity_bytes=8 * FILE)  # 4 files may be pinned
        drv, pin_drv = TierDriver(tier), TierDriver(tier, "pinned")
        pin_drv.req = ReqContext("pinned", {"cache_ttl_s": 60})

        def stats():
            return ray.get(tier.actor.stats.remote()).figures

        pinned, twin = _keys(2), _keys(2)
        assert pin_drv.store(pinned, [0, 1]).success
        assert drv.store(twin, [2, 3]).success  # the same age, unpinned
        for _ in range(12):  # 24 files: three times the capacity
            assert drv.store(_keys(2), [4, 5]).success
            assert _disk_bytes(root) <= 8 * FILE
        assert _held(raykv_services, pinned + twin) == [True, True, False, False]
        assert os.path.exists(_path(root, pinned[0]))
        figures = stats()
        assert figures["pinned_blocks"] == 2 and figures["tenant_pinned_bytes"] == {"": 2 * FILE}
        assert figures["pin_expiries"][0]["blocks"] == 2

        more, over = _keys(2), _keys(2)
        assert pin_drv.store(more, [6, 7]).success
        assert pin_drv.store(over, [0, 1]).success  # over the cap: stored, unpinned, counted
        figures = stats()
        assert figures["pins_refused_tier_cap"] == 2 and figures["pinned_blocks"] == 4
        assert _held(raykv_services, over) == [True, True]

        assert tier.unpin(Unpin(keys=tuple(scoped_keys(more)))) == 2
        tier.touch(more, pin_drv.req)  # a request with a TTL uses them: pinned again
        wait_until(lambda: stats()["pinned_blocks"] == 4, timeout_s=10, what="touch pinned")
        assert tier.unpin(Unpin(tenants=("",))) == 4
        assert stats()["pinned_blocks"] == 0

        assert pin_drv.store(pinned, [0, 1]).success
        assert stats()["pinned_blocks"] == 2
        held = stats()["files"]
        assert ray.get(tier.actor.drop_identities.remote([tier.key_tag])) == held
        figures = stats()
        assert figures["files"] == 0 and figures["pinned_blocks"] == 0
        assert not os.path.exists(_path(root, pinned[0]))
        tier.shutdown()


@pytest.mark.timeout(120)
def test_a_load_the_storage_never_answers_fails_at_its_deadline(raykv_services, tmp_path):
    """A block file whose read blocks (a FIFO: ``open`` waits for a writer, as reads wait on
    a hung NFS mount), read by a tier of one I/O thread. The load job fails at
    ``job_timeout_s`` with the blocks read in time loaded; while its one thread waits, the
    tier loads nothing and fails new jobs at once; the read that returns late lands in no
    primary slot (vLLM reuses a failed job's slots). Before, the job, and the vLLM request
    waiting on it, waited for as long as the storage did."""
    root = tmp_path / "kv"
    keys = _keys(3)
    with PrimaryRegion(8, BLOCK) as src, PrimaryRegion(8, BLOCK) as dst:
        _fill(src, 7)
        writer = _tier(raykv_services, root, src.view)
        assert TierDriver(writer).store(keys, [0, 1, 2]).success
        hung = _path(root, keys[1])
        os.unlink(hung)
        os.mkfifo(hung, 0o600)
        reader = _tier(raykv_services, root, dst.view, job_timeout_s=1.0, io_threads=1)
        t0 = time.monotonic()
        (res,) = _run_jobs(reader, [("load", [keys[0], keys[2], keys[1]], [3, 5, 4])])
        assert 1.0 <= time.monotonic() - t0 < 5.0
        assert not res.success and sorted(res.successful_keys) == sorted([keys[0], keys[2]]), res.error
        assert "no answer from the storage within job_timeout_s=1s" in res.error
        assert failure_reason(res.error) == "timeout"  # the metric's and the log's reason
        assert np.array_equal(dst.array[3], src.array[0]) and np.array_equal(dst.array[5], src.array[2])

        assert reader._deadlines.stalled and not reader.can_load(reader.holder_info)
        (refused,) = _run_jobs(reader, [("load", keys[:1], [6])])
        assert not refused.success and "storage unavailable: all 1 I/O threads wait" in refused.error
        assert failure_reason(refused.error) == "holder_unavailable"

        os.close(os.open(hung, os.O_WRONLY))  # a writer at last: the blocked read returns (empty)
        wait_until(lambda: not reader._deadlines.stalled, timeout_s=10, what="the late read to return")
        assert reader.can_load(reader.holder_info)
        (again,) = _run_jobs(reader, [("load", [keys[0], keys[2]], [6, 7])])
        assert again.success, again.error

        # A read that returns late with good bytes: they land in no slot.
        load, hang = reader.storage.load, threading.Event()

        def hung_load(key: bytes, payload: memoryview) -> int:
            hang.wait(60)
            return load(key, payload)

        reader.storage.load = hung_load
        (res,) = _run_jobs(reader, [("load", keys[2:], [4])])
        assert not res.success and reader._deadlines.late == 1
        dst.array[4] = 0xAB  # the failed job's slot, reused by vLLM
        hang.set()
        wait_until(lambda: reader._deadlines.late == 0, timeout_s=10, what="the late read to return")
        assert (dst.array[4] == 0xAB).all(), "a read that returned after its job failed wrote into the slot"
        reader.shutdown()
        writer.shutdown()


@pytest.mark.timeout(120)
def test_a_store_the_storage_never_answers_fails_and_writes_only_the_bytes_it_had(raykv_services, tmp_path):
    """A store whose write blocks (the storage's ``store`` call waits, as a write to a
    hung mount does): the job fails at ``job_timeout_s``; vLLM then reuses its slots, and
    the write that goes on later still writes the bytes the slot held while the job lived.
    One thread of four waiting is no stall: the others store meanwhile."""
    keys = _keys(3)
    with PrimaryRegion(4, BLOCK) as src:
        _fill(src, 9)
        original = src.array[1].copy()
        tier = _tier(raykv_services, tmp_path / "kv", src.view, job_timeout_s=1.0)
        store, hang = tier.storage.store, threading.Event()

        def hung_store(key: bytes, payload: memoryview, fsync: bool) -> int:
            if key == scoped_keys(keys[1:])[0]:
                hang.wait(60)
            return store(key, payload, fsync)

        tier.storage.store = hung_store
        (res,) = _run_jobs(tier, [("store", keys[:2], [0, 1])])
        assert not res.success and list(res.successful_keys) == [keys[0]], res.error
        assert failure_reason(res.error) == "timeout", res.error
        assert tier._deadlines.late == 1 and not tier._deadlines.stalled
        (other,) = _run_jobs(tier, [("store", keys[2:], [2])])
        assert other.success, other.error
        src.array[1] = 0xCD  # vLLM reuses the slot for another block
        hang.set()
        wait_until(lambda: tier._deadlines.late == 0, timeout_s=10, what="the late write to return")
        buf = np.empty(BLOCK, np.uint8)
        tier.storage.load(scoped_keys(keys[1:])[0], buf.data)  # the file the late write left
        assert np.array_equal(buf, original), "a write that went on after its job failed wrote the new bytes"
        tier.shutdown()
