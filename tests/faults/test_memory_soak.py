"""Memory soak: raykv's processes do not grow under steady churn, and the
books balance at the end.

A store / load / evict workload of three tenants runs against the object
store and fs tiers (capacities a fraction of the keyspace, so every second
evicts) for ``RAYKV_MEMORY_SOAK_S`` seconds (``make test-soak``: 300; 3600 for the
hour-long run). Once a second it samples the RSS of every raykv actor process
of this test's Ray and of this process (the tiers' clients, with pytest and
the Ray driver), and ``/dev/shm`` use. After a warm-up (``MAX_WARM_UP_S``: the first
half of the run, at most 15 minutes) each process's growth is the least-squares slope of its private
memory (RSS less shared pages: plasma pages an actor touched are not its
leak), in MiB per hour; raykv's actors are held to the bound, this process is reported.

The bound, ``MAX_GROWTH_MIB_PER_H`` = 64: the soak stores ~600 blocks a
second (150 store jobs), so a leak of 32 bytes per stored block (one key
object left in a list) grows an actor by ~65 MiB an hour and fails it; a full
KV-event ring did: the object-store actor grew 58 MiB in 5 minutes (228
MiB/h) before the ring was kept only while read (``raykv.holders.events``).
At the end: directory keys = holder keys = files on disk, byte counts exact,
and the bytes per tenant add up to each holder's bytes.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import numpy as np
import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import raykv  # noqa: E402
from raykv.bench.cpu import process_role  # noqa: E402
from raykv.core.factory import TierFactory  # noqa: E402
from raykv.engine.primary import PrimaryRegion  # noqa: E402

NS = "raykv-memory-soak"
MiB = 1 << 20
MAX_GROWTH_MIB_PER_H = 64.0
TENANTS = ("tenant-a", "tenant-b", None)
#: Processes whose RSS is watched: raykv's actors by class (their process title).
ACTOR_ROLES = ("ObjectStoreActor", "FsRootActor", "DirectoryShard", "DirectoryAgent", "ControlActor")

#: Growth is measured after a warm-up: the first half of the run, at most 15 minutes. The
#: hour-long run (2026-11-27, every sample kept with ``RAYKV_MEMORY_SOAK_CSV``) shows why: the
#: actors' private memory climbs for their first 3-5 minutes (allocator arenas, bounded caches
#: and logs filling) and then stays flat (0.1-2.1 MiB/h over the hour). Over minutes 1.25-5 they
#: grew at 12-52 MiB/h, too near the bound for a 5-minute CI run; over minutes 2.5-5, 3-22 MiB/h.
MAX_WARM_UP_S = 900.0

pytestmark = [pytest.mark.soak, pytest.mark.timeout(4000)]


def _processes() -> dict[str, psutil.Process]:
    """raykv's actor processes of this test's Ray, by role, and this process.

    Actor workers are children of their node's raylet; this Ray's raylet is the
    one started with this session's directory (other Rays may share the host)."""
    import ray

    session = os.path.dirname(os.path.dirname(ray.nodes()[0]["ObjectStoreSocketName"]))
    found: dict[str, psutil.Process] = {"test process (tier clients)": psutil.Process()}
    for proc in psutil.process_iter():
        try:
            role = process_role(proc)
            if role not in ACTOR_ROLES:
                continue
            parent = proc.parent()
            if parent is None or session not in " ".join(parent.cmdline()):
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found[role if role not in found else f"{role} {proc.pid}"] = proc
    return found


def growth_mib_per_hour(times: list[float], rss: list[float]) -> float:
    """Least-squares slope of RSS (bytes) over time (s), in MiB per hour."""
    t = np.asarray(times) - times[0]
    slope = np.polyfit(t, np.asarray(rss), 1)[0]
    return float(slope * 3600 / MiB)


def test_growth_rule_finds_a_leak_and_not_noise() -> None:
    t = [float(i) for i in range(300)]
    flat = [100 * MiB + (i % 7) * 0.3 * MiB for i in range(300)]  # wobble, no trend
    leak = [100 * MiB + i * 1024 * 17 for i in range(300)]  # 17 KiB/s: 60 MiB/h
    assert abs(growth_mib_per_hour(t, flat)) < 2
    assert growth_mib_per_hour(t, leak) == pytest.approx(17 * 3600 / 1024, rel=0.01)


@pytest.fixture(scope="module")
def soak_services(ray_local):
    services = raykv.start({"namespace": NS, "directory_shards": 2})
    yield services
    services.shutdown()


def test_memory_stays_flat_and_the_books_balance(soak_services, tmp_path) -> None:
    seconds = float(os.environ.get("RAYKV_MEMORY_SOAK_S", 300))
    region = PrimaryRegion(32, harness.BLOCK)
    tiers = {
        "object_store": TierFactory.create_tier(
            {"type": "object_store", "namespace": NS, "capacity_bytes": 2 * MiB}, region.view, services=soak_services
        ),
        "fs": TierFactory.create_tier(
            {"type": "fs", "namespace": NS, "root": str(tmp_path / "kv"), "capacity_bytes": 3 * MiB, "fsync": False},
            region.view,
            services=soak_services,
        ),
    }
    procs = _processes()
    assert {"ObjectStoreActor", "FsRootActor", "DirectoryShard"} <= set(procs), sorted(procs)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
    shm: list[float] = []
    restarts: list[str] = []
    rss_now: dict[str, float] = {}
    totals: dict[str, int] = {}
    t0 = time.monotonic()
    next_sample = t0
    seed = 0
    try:
        while time.monotonic() - t0 < seconds:
            seed += 1
            work = harness.Workload(tiers, region.array, keyspace=96, seed=seed, tenants=TENANTS)
            end = min(time.monotonic() + 5.0, t0 + seconds)
            while time.monotonic() < end:
                work.step()
                now = time.monotonic()
                if now >= next_sample:
                    next_sample = now + 1.0
                    for name, proc in list(procs.items()):
                        try:
                            mem = proc.memory_info()
                            # private memory: RSS less pages shared with other processes (plasma
                            # and /dev/shm pages an actor touched count in its RSS, not as a leak)
                            samples.setdefault(name, []).append((now - t0, float(mem.rss - mem.shared)))
                            rss_now[name] = float(mem.rss)
                        except psutil.NoSuchProcess:  # restarted by Ray: a new series from its new process
                            restarts.append(f"{name} (pid {proc.pid}) at {now - t0:.0f} s")
                            print(f"\n{restarts[-1]} gone")
                            procs = _processes()
                            samples[name] = []
                    shm.append(float(shutil.disk_usage("/dev/shm").used))
                time.sleep(0.002)  # not a wait: paces the workload's steps (open-loop traffic)
            rep = work.drain(60.0)
            harness.assert_clean(rep)
            for k, v in rep.items():
                if isinstance(v, int) and k != "slot_refs":
                    totals[k] = totals.get(k, 0) + v
        problems = harness.wait_invariants(soak_services, timeout=30)
        assert not problems, problems
        tenant_problems = _tenant_books(soak_services)
        assert not tenant_problems, tenant_problems
    finally:
        for t in tiers.values():
            t.shutdown()
        region.close()
    _write_samples(samples)
    rows = []
    warm_up_s = min(seconds / 2, MAX_WARM_UP_S)
    for name, pts in samples.items():
        kept = [p for p in pts if p[0] >= warm_up_s]
        if len(kept) < 10:
            continue
        growth = growth_mib_per_hour([p[0] for p in kept], [p[1] for p in kept])
        rows.append((name, pts[0][1] / MiB, pts[-1][1] / MiB, growth, rss_now.get(name, 0.0) / MiB))
    print(f"\nmemory soak, {seconds:.0f} s, {len(shm)} samples; ops {totals}")
    print(f"{'process':34} {'private MiB start':>17} {'end':>8} {'growth MiB/h':>13} {'RSS end MiB':>12}")
    for name, first, last, growth, rss in rows:
        print(f"{name:34} {first:17.1f} {last:8.1f} {growth:13.1f} {rss:12.1f}")
    print(f"/dev/shm used: {shm[0] / MiB:.1f} -> {shm[-1] / MiB:.1f} MiB; processes gone meanwhile: {restarts}")
    # raykv's own processes are held to the bound; the test process (pytest, the
    # harness, the Ray driver) is reported beside them: its Python heap does not
    # grow (tracemalloc: ~100 KiB over a minute of this churn), its RSS does, in
    # Ray's native driver state, which is not raykv's and not an engine's.
    too_fast = [
        (name, round(g, 1))
        for name, _, _, g, _ in rows
        if g > MAX_GROWTH_MIB_PER_H and name.split(" ")[0] in ACTOR_ROLES
    ]
    assert not too_fast, f"private memory grows faster than {MAX_GROWTH_MIB_PER_H} MiB/h after warm-up: {too_fast}"


def _write_samples(samples: dict[str, list[tuple[float, float]]]) -> None:
    """Every sample as CSV (process, seconds, private bytes) to ``RAYKV_MEMORY_SOAK_CSV``,
    when set: the curve behind the table, for a long run's note."""
    path = os.environ.get("RAYKV_MEMORY_SOAK_CSV")
    if not path:
        return
    with open(path, "w") as out:
        out.write("process,seconds,private_bytes\n")
        for name, pts in samples.items():
            out.writelines(f"{name},{t:.1f},{b:.0f}\n" for t, b in pts)


def _tenant_books(services) -> list[str]:
    """Each live holder's bytes per tenant add up to its bytes."""
    problems = []
    for hid, h in harness.holdings(services).items():
        if not h["alive"]:
            continue
        st = h["stats"]
        used = st.get("bytes_used", st.get("bytes"))
        by_tenant = st.get("tenant_bytes") or {}
        if sum(by_tenant.values()) != used:
            problems.append(f"{hid}: tenants hold {sum(by_tenant.values())} bytes, the holder {used}: {by_tenant}")
    return problems
