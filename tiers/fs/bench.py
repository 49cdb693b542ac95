"""Micro-benchmark: the fs tier vs raw file I/O of the same bytes.

    python -m tiers.fs.bench --root /mnt/shared/bench --blocks 128 --block-mib 2

For each thread count it times, over the same ``--blocks`` blocks:

- raw write: ``open(O_CREAT|O_EXCL)`` + ``write`` (+ ``fsync`` with --fsync) + ``close``
  per block, no header, no checksum, no rename;
- raw read: ``open`` + ``readv`` into the primary slot + ``close``;
- tier store / load: ``FsTier`` jobs of ``--job-blocks`` blocks through a
  local Ray (header + crc32, temp file + rename, fsync of file and directory
  with --fsync, batched commit to the root actor, directory registration).

``--cold`` drops the files' pages from the page cache (``posix_fadvise
DONTNEED`` after an fsync) before each read phase, so reads hit the device.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MiB = 1024 * 1024


def _drop_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw(root: str, arr: np.ndarray, n: int, threads: int, fsync: bool, cold: bool) -> tuple[float, float]:
    os.makedirs(root, exist_ok=True)

    def write(i: int) -> None:
        fd = os.open(os.path.join(root, f"{i}.raw"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, memoryview(arr[i]))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(os.path.join(root, f"{i}.raw"), os.O_RDONLY)
        try:
            os.readv(fd, [memoryview(arr[n - 1 - i])])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        os.sync()  # start each write phase with no dirty pages from earlier ones
        t0 = time.perf_counter()
        list(ex.map(write, range(n)))
        tw = time.perf_counter() - t0
        if cold:
            _drop_cache(root)
        t0 = time.perf_counter()
        list(ex.map(read, range(n)))
        tr = time.perf_counter() - t0
    shutil.rmtree(root)
    return tw, tr


def _warm_dirs(root: str) -> None:
    os.mkdir(root, 0o700)
    for a in range(256):
        top = os.path.join(root, f"{a:02x}")
        os.mkdir(top, 0o700)
        for b in range(256):
            os.mkdir(os.path.join(top, f"{b:02x}"), 0o700)


def _tier(
    services, root: str, region, n: int, threads: int, fsync: bool, cold: bool, job_blocks: int, checksum: str
) -> tuple[float, float, bool]:
    from raykv.contract import ReqContext, TransferJob
    from raykv.factory import TierFactory
    from raykv.keys import prefix_keys

    tier = TierFactory.create_tier(
        {"type": "fs", "root": root, "io_threads": threads, "fsync": fsync, "capacity_bytes": 0, "checksum": checksum},
        region.view,
        services=services,
    )
    keys = prefix_keys(list(np.random.default_rng().integers(0, 1 << 40, n)), 1)
    req = ReqContext("bench")

    def run(kind: str, order: list[int]) -> tuple[float, bool]:
        t0 = time.perf_counter()
        for j in range(0, n, job_blocks):
            idx = order[j : j + job_blocks]
            job = TransferJob(j + (0 if kind == "store" else n), [keys[i] for i in range(j, j + len(idx))], np.asarray(idx), kind == "load", req)
            (tier.submit_store if kind == "store" else tier.submit_load)(job)
        tier.drain_jobs()
        dt = time.perf_counter() - t0
        return dt, all(r.success for r in tier.get_finished_jobs())

    os.sync()
    tw, ok_w = run("store", list(range(n)))
    if cold:
        _drop_cache(root)
    tr, ok_r = run("load", list(range(n))[::-1])
    tier.shutdown()  # its root actor stays until services.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    return tw, tr, ok_w and ok_r


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="directory to benchmark in (default: a temp dir under /tmp)")
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--job-blocks", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--fsync", action="store_true")
    p.add_argument("--cold", action="store_true")
    p.add_argument("--checksum", default="auto", help="the tier's checksum option")
    p.add_argument(
        "--warm-dirs",
        action="store_true",
        help="create the tier's 65536 fan-out directories first, as in a root that has run a while",
    )
    p.add_argument("--repeat", type=int, default=3, help="alternating runs; the best of each is shown")
    args = p.parse_args(argv)

    import ray

    import raykv
    from raykv.primary import PrimaryRegion

    base = args.root or tempfile.mkdtemp(prefix="raykv-fs-bench-")
    n, bs = args.blocks, int(args.block_mib * MiB)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    services = raykv.start({"namespace": "raykv-fs-bench"})
    total = n * bs / 1e9
    from tiers.fs import format as fmt

    algo = fmt.ALGORITHM_NAMES[fmt.resolve_algorithm(args.checksum)]
    print(f"{n} blocks x {bs / MiB:g} MiB under {base} (fsync={args.fsync}, cold reads={args.cold}, checksum={algo}, warm dirs={args.warm_dirs})")
    print(f"{'threads':>7} {'raw write':>10} {'tier store':>11} {'raw read':>9} {'tier load':>10}   GB/s")
    with PrimaryRegion(n, bs) as region:
        region.array[:] = np.random.default_rng(0).integers(0, 256, region.array.shape, dtype=np.uint8)
        for threads in args.threads:
            best = [float("inf")] * 4
            ok = True
            for rep in range(args.repeat):  # alternate, so both see the same machine state
                if args.warm_dirs:
                    _warm_dirs(os.path.join(base, f"tier-{threads}-{rep}"))
                rw, rr = _raw(os.path.join(base, "raw"), region.array, n, threads, args.fsync, args.cold)
                tw, tr, good = _tier(
                    services, os.path.join(base, f"tier-{threads}-{rep}"), region, n, threads, args.fsync, args.cold, args.job_blocks,
                    args.checksum,
                )
                ok &= good
                best = [min(a, b) for a, b in zip(best, (rw, tw, rr, tr))]
            rw, tw, rr, tr = best
            flag = "" if ok else "  (some jobs FAILED)"
            print(f"{threads:>7} {total / rw:>10.2f} {total / tw:>11.2f} {total / rr:>9.2f} {total / tr:>10.2f}{flag}")
    services.shutdown()
    ray.shutdown()
    if args.root is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
