"""``raykv bench view-reads``: engines' reads of the node's directory view while its agent
changes it, on a host whose every core is busy.

A writer process plays the node's agent: a view of every key (``NodeView`` published by
``ViewWriter`` in ``/dev/shm``), growing by ``--keys-per-change`` keys every
``--change-every-ms`` (its table is rebuilt as it grows). ``--busy`` processes spin on the
CPU beside it, as a CPU engine's threads do. This process plays an engine: it reads a
``--prefix-keys`` prefix from the view every millisecond for ``--seconds``, twice in the
same run:

- **naps**: raykv's reader, which sleeps ``READ_NAP_S`` between tries while the writer is
  mid-change (``raykv.directory.shm_view``);
- **yields** (the baseline): the same reader calling ``sched_yield`` instead, as raykv did
  before 2026-12-06. A yielding reader stays runnable and keeps its core.

Reported per mode: reads given up (the engine then asks the agent, that same descheduled
process: a call, and a RETRY when its answer is late) per 1,000 reads, and read time
p50 / p99 / p99.9. No Ray.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

from raykv.bench.common import (
    above_zero,
    at_least,
    entries,
    fill_defaults,
    machine,
    num,
    percentile,
    section,
    table,
    target,
    targets_table,
)
from raykv.core.wire import HolderInfo, Report

HELP = "reads of the node's directory view while its agent changes it, every core busy: naps vs yields"

FULL = {"seconds": 10.0, "busy": None, "change_every_ms": 0.5, "keys_per_change": 7, "prefix_keys": 32}
QUICK = {"seconds": 2.0}
#: Reads given up per 1,000 with naps, at most (target).
MAX_GIVEN_UP_PER_1000 = 2.0
#: The holders the writer registers keys to, in turn.
_HOLDERS = [HolderInfo(f"engine-{i}", "object_store", "PLASMA", f"h{i}", "bench", node_id="node") for i in range(3)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, help=f"reading time per mode (default {FULL['seconds']:g}; --quick 2)")
    p.add_argument("--busy", type=int, help="processes spinning on the CPU beside the writer (default: one per core)")
    p.add_argument("--change-every-ms", type=float, help="the writer's pause between changes (default 0.5)")
    p.add_argument("--keys-per-change", type=int, help="keys each change registers (default 7: a request's blocks)")
    p.add_argument("--prefix-keys", type=int, help="keys each read looks up (default 32)")


def run(args: argparse.Namespace) -> Report:
    fill_defaults(args, FULL, QUICK)
    if args.busy is None:
        args.busy = os.cpu_count() or 1
    above_zero(seconds=args.seconds, change_every_ms=args.change_every_ms)
    at_least(0, busy=args.busy)
    at_least(1, keys_per_change=args.keys_per_change, prefix_keys=args.prefix_keys)
    from raykv.directory.shm_view import READ_NAP_S

    modes = [("naps", READ_NAP_S), ("yields", 0.0)]
    quiet = logging.getLogger("raykv.directory.shm_view")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # reads given up are what it counts: not a warning each
    try:
        rows = [_one_mode(name, nap_s, args) for name, nap_s in modes]
    finally:
        quiet.setLevel(level)
    by = {r["mode"]: r for r in rows}
    naps, yields = num(by["naps"]["given_up_per_1000"]), num(by["yields"]["given_up_per_1000"])
    fewer = yields / max(naps, 1000 / max(num(by["naps"]["reads"]), 1))  # none given up with naps: taken as one
    return {
        "bench": "view-reads",
        "config": {
            "seconds": args.seconds,
            "busy": args.busy,
            "change_every_ms": args.change_every_ms,
            "keys_per_change": args.keys_per_change,
            "prefix_keys": args.prefix_keys,
            "nap_us": READ_NAP_S * 1e6,
        },
        "rows": list(rows),
        "given_up_x_fewer": fewer,
        "targets": [
            target("reads given up per 1,000 (naps)", naps, MAX_GIVEN_UP_PER_1000, higher_is_better=False),
            target(
                "reads given up: x fewer than with yields",
                fewer,
                1.0,
                detail="the baseline, same run (none with naps: counted as one)",
            ),
        ],
        "machine": machine(),
    }


def format_result(result: Report) -> str:
    config = section(result["config"])
    body = [
        (
            r["mode"],
            r["reads"],
            r["given_up"],
            r["given_up_per_1000"],
            r["read_p50_us"],
            r["read_p99_us"],
            r["read_p999_us"],
            r["view_keys"],
        )
        for r in map(section, entries(result["rows"]))
    ]
    title = (
        f"raykv bench view-reads: {config['prefix_keys']}-key reads every 1 ms for {config['seconds']:g} s per mode; "
        f"the writer registers {config['keys_per_change']} keys every {config['change_every_ms']:g} ms; "
        f"{config['busy']} busy processes"
    )
    headers = ["mode", "reads", "given up", "per 1000", "p50 us", "p99 us", "p99.9 us", "view keys at end"]
    return table(headers, body, title=title) + "\n\n" + targets_table(result["targets"])


def _one_mode(mode: str, nap_s: float, args: argparse.Namespace) -> Report:
    """One reading period beside a fresh writer and the busy processes."""
    from raykv.directory.shm_view import ViewReader, view_path

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        path = view_path("bench", "node", folder)
        stop, ready, written = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        writer = ctx.Process(
            target=_write,
            args=(path, args.change_every_ms / 1e3, args.keys_per_change, stop, ready, written),
            daemon=True,
        )
        busy = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
        for p in (writer, *busy):
            p.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the view writer did not start within 60 s")
            reader = ViewReader(path, nap_s=nap_s)
            prefix = [os.urandom(44) for _ in range(args.prefix_keys)]
            times: list[float] = []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                t0 = time.perf_counter_ns()
                reader.lookup(prefix)
                times.append((time.perf_counter_ns() - t0) / 1e3)
                time.sleep(0.001)
        finally:
            stop.set()
            for p in (writer, *busy):
                p.join(10)
                if p.is_alive():
                    p.kill()
        given_up = sum(reader.gave_up.values())
        return {
            "mode": mode,
            "nap_us": nap_s * 1e6,
            "reads": len(times),
            "given_up": given_up,
            "given_up_why": dict(reader.gave_up),
            "given_up_per_1000": 1000 * given_up / max(len(times), 1),
            "read_p50_us": percentile(times, 50),
            "read_p99_us": percentile(times, 99),
            "read_p999_us": percentile(times, 99.9),
            "view_keys": written.value,
        }


def _write(path: str, pause_s: float, keys_per_change: int, stop: Event, ready: Event, written: Synchronized) -> None:
    """The agent's part: a complete view, ``keys_per_change`` new keys per change."""
    from raykv.directory.fingerprint import fingerprints, to_blob
    from raykv.directory.shm_view import published_view

    writer, view = published_view(path, "node", max_keys=1 << 30, all_keys=True)  # as the agent's
    for holder in _HOLDERS:
        view.slot(0, holder)
    view.complete = True
    ready.set()
    i = 0
    while not stop.is_set():
        keys = [os.urandom(44) for _ in range(keys_per_change)]
        view.register(0, _HOLDERS[i % len(_HOLDERS)].holder_id, to_blob(fingerprints(keys)))
        writer.beat()
        i += 1
        written.value = i * keys_per_change
        time.sleep(pause_s)
    writer.close()


def _spin(stop: Event) -> None:
    """A busy process (a CPU engine's thread spinning between steps)."""
    while not stop.is_set():
        pass
