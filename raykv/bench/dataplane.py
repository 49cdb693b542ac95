"""``raykv bench dataplane``: store/load throughput of the tiers vs baselines of the same run.

On an embedded two-node Ray (``ray.cluster_utils.Cluster`` on this host), for
each block size and batch (blocks per job) it times, round after round on the
same primary region (store from even chunks, load into odd chunks, so nothing
coalesces and loads land in other slots than stores read):

- ``memcpy``: single-thread ``np.copyto`` of the same blocks (the floor any
  copy path pays once; the object store tier's baseline);
- ``object_store`` store / load jobs through ``TierDriver`` (actor call,
  region mapping, packed ``ray.put`` / zero-copy ``ray.get`` + copy, directory
  registration, ``JobResult``), on the driver's node;
- ``fs`` store / load jobs (checksummed block files, commit to the root
  actor, directory registration) under ``--root``;
- ``raw_file``: ``open``/``write``/``close`` and ``open``/``readv``/``close`` of
  the same bytes, no header, checksum, rename or commit, in the same
  directory with as many threads as the fs tier has (its baseline);
- ``vllm_fs``: vLLM's own ``fs`` tier (``FileSystemTierManager``) driven
  through its tier API on the same blocks and primary buffer, as vLLM
  configures itself (``O_DIRECT`` where the filesystem takes it), and again
  with buffered I/O (``vllm_fs_buffered``: the same page cache as the others);
- ``cross_node``: blocks stored on node A, loaded by an engine actor on node B
  (Ray's object manager pulls the packs), at the headline batch.

Medians over ``--rounds`` rounds after one warm-up round. Plasma is
preallocated (``RAY_preallocate_plasma_memory=1``) so the numbers are those
of a warm arena, not of first-touch page faults. The fs tier and the raw
files run without fsync (vLLM's tier never fsyncs) unless ``--fsync``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raykv.bench.common import (
    MiB,
    Progress,
    as_json,
    at_least,
    counts_option,
    entries,
    gbps,
    machine,
    median,
    number,
    ratio,
    section,
    size_label,
    table,
    target,
    targets_table,
)
from raykv.core import signals
from raykv.core.keys import OffloadKey
from raykv.core.units import parse_size
from raykv.core.validate import ArgumentError
from raykv.core.wire import JsonValue, Report

if TYPE_CHECKING:
    from raykv.core.contract import SecondaryTier
    from raykv.engine.primary import PrimaryRegion
    from raykv.integrations.vllm.fs_baseline import VllmFsTier
    from raykv.services.cluster import RaykvServices
    from tiers.object_store.tier import ObjectStoreTier

#: Per series (``<series>_gbps``, ``_us_per_block``, ...): a number, or None when not measured.
Row = dict[str, float | None]

HELP = "store/load GB/s per tier vs memcpy, raw file I/O and vLLM's fs tier (same node and across nodes)"

FULL_BLOCK_SIZES = "64KiB,512KiB,2MiB"
FULL_BATCHES = "1,4,16,32,64,128"
QUICK_BATCHES = "1,8"
NAMESPACE = "raykv-bench-dataplane"
#: What the benchmark writes under its root (removed at the end).
SUBDIRS = ("raw", "raykv-fs", "vllm-fs", "vllm-fs-buffered")
#: (prefix of JSON keys, what it is) in table order.
SERIES = (
    ("memcpy", "memcpy"),
    ("object_store_store", "object_store store"),
    ("object_store_load", "object_store load"),
    ("fs_store", "fs store"),
    ("fs_load", "fs load"),
    ("raw_file_write", "raw file write"),
    ("raw_file_read", "raw file read"),
    ("vllm_fs_store", "vLLM fs store"),
    ("vllm_fs_load", "vLLM fs load"),
    ("vllm_fs_buffered_store", "vLLM fs store (buffered)"),
    ("vllm_fs_buffered_load", "vLLM fs load (buffered)"),
)
#: series -> baseline series for the per-block overhead.
BASELINE_OF = {
    "object_store_store": "memcpy",
    "object_store_load": "memcpy",
    "fs_store": "raw_file_write",
    "fs_load": "raw_file_read",
    "vllm_fs_store": "raw_file_write",
    "vllm_fs_load": "raw_file_read",
    "vllm_fs_buffered_store": "raw_file_write",
    "vllm_fs_buffered_load": "raw_file_read",
    "cross_node_load": "memcpy",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-sizes", default=None, help=f"comma-separated (default {FULL_BLOCK_SIZES})")
    p.add_argument(
        "--batches",
        default=None,
        help=f"blocks per job, comma-separated (default {FULL_BATCHES}; quick {QUICK_BATCHES})",
    )
    p.add_argument(
        "--headline-batch",
        type=int,
        default=None,
        help="batch of the per-block-size summary (default 32, or the largest)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per configuration, after 1 warm-up (default 7; quick 2)"
    )
    p.add_argument(
        "--root",
        default=None,
        help="directory for the fs tier, raw files and vLLM's fs tier (default: a temp dir under /tmp)",
    )
    p.add_argument("--io-threads", type=int, default=4, help="fs tier I/O threads (the raw baseline uses as many)")
    p.add_argument("--fsync", action="store_true", help="fsync fs tier and raw files (vLLM's tier never does)")
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the files' pages from the page cache before each read (reads hit the device)",
    )
    p.add_argument("--checksum", default="auto", help="the fs tier's checksum option (auto: fastest installed)")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's fs tier")
    p.add_argument("--no-cross-node", action="store_true", help="skip the second node")


# -- raw files -------------------------------------------------------------------
def drop_cache(root: str) -> None:
    """Write back and drop the page cache of every file under ``root`` (``--cold``)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue  # renamed or evicted meanwhile
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class RawFiles:
    """Raw write/read of the blocks, one file each, with ``threads`` threads."""

    def __init__(self, root: str, threads: int, fsync: bool) -> None:
        self.root = os.path.join(root, "raw")
        os.makedirs(self.root, exist_ok=True)
        self.fsync = fsync
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raykv-bench-raw")

    def write(self, arr: np.ndarray, chunks: list[int]) -> bool:
        def one(i: int) -> None:
            fd = os.open(os.path.join(self.root, f"{i}.raw"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, memoryview(arr[chunks[i]]))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        list(self.pool.map(one, range(len(chunks))))
        return True

    def read(self, arr: np.ndarray, chunks: list[int]) -> bool:
        def one(i: int) -> int:
            fd = os.open(os.path.join(self.root, f"{i}.raw"), os.O_RDONLY)
            try:
                return os.readv(fd, [memoryview(arr[chunks[i]])])
            finally:
                os.close(fd)

        sizes = list(self.pool.map(one, range(len(chunks))))
        return all(s == arr.shape[1] for s in sizes)

    def clear(self) -> None:
        for name in os.listdir(self.root):
            os.unlink(os.path.join(self.root, name))

    def close(self) -> None:
        self.pool.shutdown()


# -- the second node -----------------------------------------------------------------
def _engine_class() -> Any:  # a Ray actor class (Ray's stubs type it as the Python class)
    import ray

    @ray.remote(num_cpus=0)
    class RemoteEngine:
        """An engine on node B: a primary region and an object_store tier."""

        def __init__(self, namespace: str, capacity: int) -> None:
            self.namespace = namespace
            self.capacity = capacity
            self.region: PrimaryRegion | None = None
            self.tier: ObjectStoreTier | None = None

        def setup(self, num_chunks: int, block_bytes: int) -> str:
            import raykv
            from raykv.core.factory import TierFactory
            from raykv.engine.primary import PrimaryRegion
            from tiers.object_store.tier import ObjectStoreTier

            self.close()
            self.region = PrimaryRegion(num_chunks, block_bytes)
            self.region.array[:] = 1  # fault the pages in, as a live engine's primary would be
            tier = TierFactory.create_tier(
                {"type": "object_store", "capacity_bytes": self.capacity},
                self.region.view,
                services=raykv.attach(self.namespace),
            )
            assert isinstance(tier, ObjectStoreTier)
            self.tier = tier
            return tier.node_id

        def load(self, keys: list[OffloadKey], chunks: list[int], expect: list[bytes]) -> tuple[float, bool]:
            """Seconds of a load job of ``keys`` (looked up first, untimed)."""
            from raykv.engine.tier_driver import TierDriver

            assert self.tier is not None and self.region is not None, "setup() first"
            self.tier.lookup_blocking(keys)
            t0 = time.perf_counter()
            res = TierDriver(self.tier).load(keys, chunks)
            dt = time.perf_counter() - t0
            ok = res.success and all(self.region.array[chunks[i]][:64].tobytes() == e for i, e in enumerate(expect))
            return dt, ok

        def close(self) -> None:
            if self.tier is not None:
                self.tier.shutdown()
                self.tier = None
            if self.region is not None:
                self.region.close()
                self.region = None

    return RemoteEngine


# -- the benchmark ---------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What one run measures (its ``config`` in the report, but ``progress``)."""

    quick: bool
    block_sizes: list[int]
    batches: list[int]
    headline_batch: int
    rounds: int
    io_threads: int
    fsync: bool
    cold: bool
    checksum: str
    vllm: bool
    cross_node: bool
    progress: bool


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(getattr(args, "quick", False))
    sizes = counts_option("--block-sizes", args.block_sizes or FULL_BLOCK_SIZES, parse_size)
    batches = sorted(set(counts_option("--batches", args.batches or (QUICK_BATCHES if quick else FULL_BATCHES))))
    at_least(1, headline_batch=args.headline_batch, rounds=args.rounds, io_threads=args.io_threads)
    _check_fs_options(args)
    headline = args.headline_batch or (32 if 32 in batches else batches[-1])
    if headline not in batches:
        batches = sorted({*batches, headline})
    return Settings(
        quick=quick,
        block_sizes=sizes,
        batches=batches,
        headline_batch=headline,
        rounds=args.rounds or (2 if quick else 7),
        io_threads=args.io_threads,
        fsync=bool(args.fsync),
        cold=bool(args.cold),
        checksum=args.checksum,
        vllm=not args.no_vllm,
        cross_node=not args.no_cross_node,
        progress=not getattr(args, "no_progress", False),
    )


def _check_fs_options(args: argparse.Namespace) -> None:
    """``--checksum`` and ``--root``, before any cluster starts (``--root`` becomes absolute)."""
    from tiers.fs.format import check_algorithm
    from tiers.fs.storage import is_uri

    problem = check_algorithm(args.checksum)
    if problem:
        raise ArgumentError("--checksum", problem)
    if args.root is not None:
        if not args.root.strip() or is_uri(args.root):
            raise ArgumentError(
                "--root", f"must be a local directory (the raw-file baseline writes there); got {args.root!r}"
            )
        args.root = os.path.abspath(args.root)


@dataclass
class VllmImport:
    """vLLM's fs tier, once imported (on a thread: it takes ~10 s), or why it could not be."""

    tier_class: type[VllmFsTier] | None = None
    version: str = ""
    error: str | None = None

    def load(self) -> None:
        try:
            from raykv.integrations.vllm.fs_baseline import VllmFsTier, vllm_version

            self.tier_class, self.version = VllmFsTier, vllm_version()
        except Exception as e:  # vLLM not installed, or an incompatible version
            self.error = repr(e)


def run(args: argparse.Namespace) -> Report:
    """Run the benchmark; returns the JSON result."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    s = _settings(args)
    machine_before = machine()  # before the run loads the machine
    vllm = VllmImport()
    importer = None
    if s.vllm:  # vLLM imports slowly: overlap it with the cluster's start
        importer = threading.Thread(target=vllm.load, daemon=True)
        importer.start()
    max_job = max(s.block_sizes) * max(s.batches)
    capacity = max(64 * MiB, 3 * max_job)  # steady state includes LRU eviction
    plasma_a = int(capacity / 0.8) + 128 * MiB
    plasma_b = max(256 * MiB, 3 * max(s.block_sizes) * s.headline_batch + 64 * MiB)
    base = args.root or tempfile.mkdtemp(prefix="raykv-bench-dataplane-")
    os.makedirs(base, exist_ok=True)

    import ray
    from ray.cluster_utils import Cluster

    import raykv

    old_prealloc = os.environ.get("RAY_preallocate_plasma_memory")
    os.environ["RAY_preallocate_plasma_memory"] = "1"  # a warm arena, not first-touch faults
    cluster: Cluster | None = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "object_store_memory": plasma_a, "include_dashboard": False},
        )
        if s.cross_node:
            cluster.add_node(num_cpus=1, resources={"raykv_bench_node_b": 1}, object_store_memory=plasma_b)
        ray.init(address=cluster.address, log_to_driver=False)
        signals.after_ray_init()
        services = raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
        if importer is not None:
            importer.join()
        result = _measure(s, machine_before, base, services, capacity, vllm)
        section(result["config"]).update(
            {
                "root": base,
                "plasma_bytes_node_a": plasma_a,
                "plasma_bytes_node_b": plasma_b if s.cross_node else None,
            }
        )
        services.shutdown()
        return result
    finally:
        if old_prealloc is None:
            os.environ.pop("RAY_preallocate_plasma_memory", None)
        else:
            os.environ["RAY_preallocate_plasma_memory"] = old_prealloc
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if args.root is None:
            shutil.rmtree(base, ignore_errors=True)
        else:  # a given root keeps only what was there before
            for sub in SUBDIRS:
                shutil.rmtree(os.path.join(base, sub), ignore_errors=True)


def _measure(
    s: Settings, machine_before: Report, base: str, services: RaykvServices, capacity: int, vllm: VllmImport
) -> Report:
    import ray

    from raykv.core.factory import TierFactory
    from raykv.engine.primary import PrimaryRegion
    from raykv.engine.tier_driver import TierDriver

    rounds = s.rounds + 1  # the first is a warm-up
    total_steps = len(s.block_sizes) * (len(s.batches) + (1 if s.cross_node else 0)) * rounds
    progress = Progress(total_steps, "dataplane", s.progress)
    remote = None
    if s.cross_node:
        remote = _engine_class().options(resources={"raykv_bench_node_b": 0.01}).remote(NAMESPACE, capacity)
    raw = RawFiles(base, s.io_threads, s.fsync)
    fs_root = os.path.join(base, "raykv-fs")
    vllm_error = vllm.error if s.vllm else "skipped (--no-vllm)"
    out_sizes: dict[str, JsonValue] = {}
    o_direct = None
    rng = np.random.default_rng(0)
    regions: list[PrimaryRegion] = []
    try:
        for bs in s.block_sizes:
            label = size_label(bs)
            maxb = max(s.batches)
            region = PrimaryRegion(2 * maxb, bs)
            regions.append(region)
            pattern = rng.integers(0, 256, 4 * MiB, dtype=np.uint8)
            flat = region.array.reshape(-1)
            for off in range(0, flat.size, pattern.size):
                n = min(pattern.size, flat.size - off)
                flat[off : off + n] = pattern[:n]
            flat[::4096] = rng.integers(0, 256, flat[::4096].size, dtype=np.uint8)  # no two blocks alike
            arr = region.array
            os_tier = TierFactory.create_tier(
                {"type": "object_store", "capacity_bytes": capacity}, region.view, services=services
            )
            fs_tier = TierFactory.create_tier(
                {
                    "type": "fs",
                    "root": fs_root,
                    "capacity_bytes": capacity,
                    "io_threads": s.io_threads,
                    "fsync": s.fsync,
                    "checksum": s.checksum,
                },
                region.view,
                services=services,
            )
            vtiers: dict[str, VllmFsTier] = {}
            if s.vllm and vllm.tier_class is not None:
                vtiers["vllm_fs"] = vllm.tier_class(region.view, os.path.join(base, "vllm-fs"), buffered=False)
                vtiers["vllm_fs_buffered"] = vllm.tier_class(
                    region.view, os.path.join(base, "vllm-fs-buffered"), buffered=True
                )
                o_direct = vtiers["vllm_fs"].o_direct
            by_batch: dict[str, Row] = {}
            failures: list[str] = []
            for n in s.batches:
                src = [2 * i for i in range(n)]
                dst = [2 * i + 1 for i in range(n)]
                times: dict[str, list[float]] = {k: [] for k, _ in SERIES}

                def timed(name: str, fn: Callable[[], bool], r: int) -> None:
                    t0 = time.perf_counter()
                    ok = fn()
                    dt = time.perf_counter() - t0
                    if not ok:
                        failures.append(f"{name} batch {n} round {r}")
                    if r > 0:
                        times[name].append(dt)

                def check() -> bool:
                    return all(np.array_equal(arr[d], arr[c]) for c, d in ((src[0], dst[0]), (src[-1], dst[-1])))

                def memcpy() -> bool:
                    for c, d in zip(src, dst):
                        np.copyto(arr[d], arr[c])
                    return True

                for r in range(rounds):
                    keys = [OffloadKey(os.urandom(32) + b"\0\0\0\0") for _ in range(n)]
                    timed("memcpy", memcpy, r)
                    arr[dst] = 0
                    timed("object_store_store", lambda: TierDriver(os_tier).store(keys, src).success, r)
                    timed("object_store_load", lambda: TierDriver(os_tier).load(keys, dst).success and check(), r)
                    arr[dst] = 0
                    timed("fs_store", lambda: _drained(fs_tier, True, keys, src), r)
                    if s.cold:
                        drop_cache(fs_root)
                    timed("fs_load", lambda: _drained(fs_tier, False, keys, dst) and check(), r)
                    arr[dst] = 0
                    timed("raw_file_write", lambda: raw.write(arr, src), r)
                    if s.cold:
                        drop_cache(raw.root)
                    timed("raw_file_read", lambda: raw.read(arr, dst) and check(), r)
                    raw.clear()
                    for name, vt in vtiers.items():
                        arr[dst] = 0
                        timed(f"{name}_store", lambda: vt.job(True, keys, src), r)
                        if s.cold:
                            drop_cache(vt.root)
                        timed(f"{name}_load", lambda: vt.job(False, keys, dst) and check(), r)
                        vt.clear()
                    progress.step(f"{label} x {n}")
                by_batch[str(n)] = _row(times, n, bs)
            head: Row = dict(by_batch[str(s.headline_batch)])
            node_b: str | None = None
            if remote is not None:
                n = s.headline_batch
                node_b = ray.get(remote.setup.remote(n, bs))
                cross: list[float] = []
                for r in range(rounds):
                    keys = [OffloadKey(os.urandom(32) + b"\0\0\0\0") for _ in range(n)]
                    src = [2 * i for i in range(n)]
                    assert TierDriver(os_tier).store(keys, src).success
                    dt, ok = ray.get(remote.load.remote(keys, list(range(n)), [arr[c][:64].tobytes() for c in src]))
                    if not ok:
                        failures.append(f"cross_node_load round {r}")
                    if r > 0:
                        cross.append(dt)
                    progress.step(f"{label} cross-node")
                ray.get(remote.close.remote())
                t = median(cross)
                head["cross_node_load_gbps"] = gbps(n * bs, t)
                head["cross_node_load_us_per_block"] = t / n * 1e6
                memcpy_gbps = head["memcpy_gbps"] or float("nan")
                head["cross_node_load_overhead_us_per_block"] = (t - n * bs / (memcpy_gbps * 1e9)) / n * 1e6
            else:
                head["cross_node_load_gbps"] = None
            head["object_store_load_vs_memcpy"] = ratio(head["object_store_load_gbps"], head["memcpy_gbps"])
            head["object_store_store_vs_memcpy"] = ratio(head["object_store_store_gbps"], head["memcpy_gbps"])
            head["cross_node_load_vs_memcpy"] = ratio(head["cross_node_load_gbps"], head["memcpy_gbps"])
            head["fs_store_vs_raw"] = ratio(head["fs_store_gbps"], head["raw_file_write_gbps"])
            head["fs_load_vs_raw"] = ratio(head["fs_load_gbps"], head["raw_file_read_gbps"])
            for v in ("vllm_fs", "vllm_fs_buffered"):
                head[f"fs_store_vs_{v}"] = ratio(head["fs_store_gbps"], head[f"{v}_store_gbps"])
                head[f"fs_load_vs_{v}"] = ratio(head["fs_load_gbps"], head[f"{v}_load_gbps"])
            out_sizes[label] = {
                "block_bytes": bs,
                "headline_batch": s.headline_batch,
                **head,
                **({"node_b": node_b} if node_b is not None else {}),
                "by_batch": as_json(by_batch),
                "failures": list[JsonValue](failures),
            }
            os_tier.shutdown()
            fs_tier.shutdown()
            for vt in vtiers.values():
                vt.close()
            arr = flat = np.empty(0, dtype=np.uint8)  # no views of the region outlive it
            regions.remove(region)
            region.close()
    finally:
        for region in regions:  # left open by an error
            region.close()
        progress.close()
        raw.close()
        if remote is not None:
            try:  # unlink node B's primary region before the actor goes
                ray.get(remote.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(remote)
    config = asdict(s)
    del config["progress"]
    result: Report = {
        "benchmark": "dataplane",
        "config": {
            **section(as_json(config)),
            "tier_capacity_bytes": capacity,
            "vllm_fs": vllm_error or f"vllm {vllm.version}, O_DIRECT={o_direct}",
            "vllm_fs_o_direct": o_direct,
            "fs_checksum": _checksum_name(s.checksum),
        },
        "machine": {**machine_before, "loadavg_1m_at_end": machine()["loadavg_1m"]},
        "block_sizes": out_sizes,
    }
    result["targets"] = _targets(result)
    return result


_job_ids = itertools.count(1)


def _drained(tier: SecondaryTier, store: bool, keys: list[OffloadKey], chunks: list[int]) -> bool:
    """One fs tier job, waited for with ``drain_jobs`` (its threads finish jobs)."""
    from raykv.core.contract import ReqContext, TransferJob

    job = TransferJob(next(_job_ids), keys, np.asarray(chunks, dtype=np.int64), not store, ReqContext("raykv-bench"))
    (tier.submit_store if store else tier.submit_load)(job)
    tier.drain_jobs()
    return all(r.success for r in tier.get_finished_jobs())


def _row(times: dict[str, list[float]], n: int, bs: int) -> Row:
    """GB/s, µs per block and per-block overhead over the baseline, per series."""
    row: Row = {}
    med = {k: median(v) for k, v in times.items() if v}
    for name, t in med.items():
        row[f"{name}_gbps"] = gbps(n * bs, t)
        row[f"{name}_us_per_block"] = t / n * 1e6
        b = BASELINE_OF.get(name)
        if b in med:
            row[f"{name}_overhead_us_per_block"] = (t - med[b]) / n * 1e6
    for name, _ in SERIES:
        row.setdefault(f"{name}_gbps", None)
    return row


def _checksum_name(option: str) -> str:
    from tiers.fs import format as fmt

    return fmt.ALGORITHM_NAMES[fmt.resolve_algorithm(option)]


def _targets(result: Report) -> list[JsonValue]:
    """The targets, read off the report (``result`` as ``run`` wrote it)."""
    out: list[JsonValue] = []
    sizes = {label: section(d) for label, d in section(result["block_sizes"]).items()}
    two = sizes.get("2MiB")
    if two is not None:
        by_batch = {b: section(row) for b, row in section(two["by_batch"]).items()}
        big = [b for b in by_batch if int(b) >= 32] or [max(by_batch, key=int)]
        for op, want in (("load", 0.5), ("store", 0.3)):
            vals = {
                b: ratio(number(by_batch[b][f"object_store_{op}_gbps"]), number(by_batch[b]["memcpy_gbps"]))
                for b in big
            }
            known = [v for v in vals.values() if v is not None]
            detail = "batch " + ", ".join(f"{b}: {v:.2f}" for b, v in vals.items() if v is not None)
            out.append(
                target(
                    f"object_store {op} / memcpy (2MiB, batch>=32, worst)",
                    min(known) if known else None,
                    want,
                    detail=detail,
                )
            )
    for key, want, what in (
        ("fs_store_vs_raw", 0.8, "fs store / raw file write"),
        ("fs_load_vs_raw", 0.8, "fs load / raw file read"),
        ("fs_store_vs_vllm_fs", 1.0, "fs store / vLLM fs store"),
        ("fs_load_vs_vllm_fs", 1.0, "fs load / vLLM fs load"),
        ("fs_store_vs_vllm_fs_buffered", 1.0, "fs store / vLLM fs store (buffered)"),
        ("fs_load_vs_vllm_fs_buffered", 1.0, "fs load / vLLM fs load (buffered)"),
    ):
        found = {label: number(d.get(key)) for label, d in sizes.items()}
        measured = {label: v for label, v in found.items() if v is not None}
        detail = ", ".join(f"{k}: {v:.2f}" for k, v in measured.items())
        worst = min(measured.values()) if measured else None
        out.append(target(f"{what} (headline batch, worst size)", worst, want, detail=detail))
    return out


def format_result(result: Report) -> str:
    """Tables: a summary per block size, then every batch."""
    parts = []
    cfg = section(result["config"])
    parts.append(
        f"dataplane: rounds={cfg['rounds']} (+1 warm-up, medians), fs io_threads={cfg['io_threads']}, "
        f"fsync={cfg['fsync']}, cold reads={cfg['cold']}, checksum={cfg['fs_checksum']}, vLLM fs: {cfg['vllm_fs']}"
    )
    sizes = {label: section(d) for label, d in section(result["block_sizes"]).items()}
    rows: list[list[object]] = []
    for name, what in (*SERIES, ("cross_node_load", "object_store load, node B pulls from A")):
        rows.append([what, *(d.get(f"{name}_gbps") for d in sizes.values())])
    hb = next(iter(sizes.values()))["headline_batch"] if sizes else "?"
    parts.append(table(("GB/s", *sizes), rows, title=f"\nThroughput at {hb} blocks per job (GB/s, decimal)"))
    ratios = (
        "object_store_load_vs_memcpy",
        "object_store_store_vs_memcpy",
        "cross_node_load_vs_memcpy",
        "fs_store_vs_raw",
        "fs_load_vs_raw",
        "fs_store_vs_vllm_fs",
        "fs_load_vs_vllm_fs",
        "fs_store_vs_vllm_fs_buffered",
        "fs_load_vs_vllm_fs_buffered",
    )
    parts.append(table(("ratio", *sizes), [[r, *(d.get(r) for d in sizes.values())] for r in ratios], title="\nRatios"))
    for label, d in sizes.items():
        by_batch = {b: section(row) for b, row in section(d["by_batch"]).items()}
        rows = []
        for b, row in by_batch.items():
            rows.append([b, *(row.get(f"{name}_gbps") for name, _ in SERIES)])
        parts.append(table(("batch", *(n for n, _ in SERIES)), rows, title=f"\n{label} blocks: GB/s per batch"))
        timed = [name for name, _ in SERIES if name in BASELINE_OF]
        rows = []
        for b, row in by_batch.items():
            rows.append([b, *(row.get(f"{name}_overhead_us_per_block") for name in timed)])
        parts.append(
            table(
                ("batch", *timed),
                rows,
                title=(
                    f"{label} blocks: per-block overhead over the baseline"
                    " (µs; object_store vs memcpy, file paths vs raw)"
                ),
            )
        )
        failures = entries(d.get("failures"))
        if failures:
            parts.append(f"FAILED jobs: {', '.join(str(f) for f in failures[:10])}")
    parts.append("\n" + targets_table(result["targets"]))
    return "\n".join(parts)
