"""Fault-test harness: an engine-like workload over real tiers, and the
cluster-wide invariants checked after every fault.

The workload drives tiers the way an engine's scheduler does: non-blocking
``lookup`` (RETRY until the batched directory answer lands), ``submit_*`` and
``get_finished_jobs`` once per step. Every block's bytes are a pure function
of its key (``expected``), so any load can be checked: a wrong or partial
block served is caught. Primary slots are refcounted per submitted job and
released by its result, so a job that never reports leaves a reference.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.keys import prefix_keys

BLOCK = 64 * 1024
BLOCKS_PER_REQ = 4
_job_ids = itertools.count(1)


def expected(key: bytes, block: int = BLOCK) -> np.ndarray:
    """The one right content of ``key``'s block."""
    seed = int.from_bytes(hashlib.sha256(bytes(key)).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, block, dtype=np.uint8)


def request_keys(i: int, salt: str | None = None) -> list[bytes]:
    """The keys of request prefix ``i`` (``BLOCKS_PER_REQ`` blocks)."""
    return prefix_keys(list(range(i * 1000, i * 1000 + 10 * BLOCKS_PER_REQ)), 10, salt=salt)


@dataclass
class _Req:
    rid: int
    keys: list[bytes]
    slots: list[int]
    started: float
    phase: str = "lookup"  # lookup -> io -> done
    jobs: set = field(default_factory=set)
    recomputed: bool = False
    tenant: str | None = None


class Workload:
    """Requests over a keyspace of prefixes, against one or more tiers."""

    def __init__(
        self,
        tiers: dict[str, Any],
        array: np.ndarray,
        keyspace: int = 48,
        seed: int = 0,
        max_requests: int = 6,
        job_deadline_s: float = 30.0,
        lookup_deadline_s: float = 10.0,
        tenants: Sequence[str | None] = (None,),
    ) -> None:
        self.tiers = tiers
        self.array = array
        self.keyspace = keyspace
        self.rng = random.Random(seed)
        self.max_requests = max_requests
        self.job_deadline_s = job_deadline_s
        self.lookup_deadline_s = lookup_deadline_s
        self.tenants = list(tenants)  # prefix i belongs to tenants[i % len(tenants)]
        self.refs = np.zeros(array.shape[0], dtype=np.int64)  # primary-slot refcounts
        self.free = list(range(array.shape[0]))
        self.reqs: dict[int, _Req] = {}
        self.jobs: dict[int, tuple[_Req, str, str, float]] = {}  # job -> (req, tier, kind, t)
        self.reported: set[int] = set()
        self.c: Counter[str] = Counter()
        self.errors: list[str] = []
        self._rids = itertools.count()

    # -- one scheduler step --------------------------------------------------
    def step(self, admit: bool = True) -> None:
        now = time.monotonic()
        while admit and len(self.reqs) < self.max_requests and len(self.free) >= BLOCKS_PER_REQ:
            i = self.rng.randrange(self.keyspace)
            slots = [self.free.pop() for _ in range(BLOCKS_PER_REQ)]
            r = _Req(next(self._rids), request_keys(i), slots, now, tenant=self.tenants[i % len(self.tenants)])
            self.reqs[r.rid] = r
            self.c["requests"] += 1
        ctxs = {t: ReqContext("w", tenant=t) for t in self.tenants}
        for r in list(self.reqs.values()):
            if r.phase != "lookup":
                continue
            ctx = ctxs[r.tenant]
            answers = {n: [t.lookup(k, ctx) for k in r.keys] for n, t in self.tiers.items()}
            if any(LookupResult.RETRY in a for a in answers.values()):
                if now - r.started > self.lookup_deadline_s:
                    self._error(f"lookup of request {r.rid} still RETRY after {self.lookup_deadline_s}s")
                    self.c["lookup_hangs"] += 1
                    self._store(r)
                continue
            hit = next((n for n, a in answers.items() if all(x == LookupResult.HIT for x in a)), None)
            if hit is None:
                self.c["misses"] += 1
                self._store(r)
            else:
                self.c[f"hit_{hit}"] += 1
                self._submit(r, hit, "load")
        for t in self.tiers.values():
            t.on_schedule_end()
        for name, t in self.tiers.items():
            for res in t.get_finished_jobs():
                self._result(name, res)
        for jid, (_r, name, kind, t0) in list(self.jobs.items()):
            if now - t0 > self.job_deadline_s:
                self._error(f"{kind} job {jid} on {name} has no result after {self.job_deadline_s}s")
                self.c["job_hangs"] += 1
                del self.jobs[jid]  # counted; its slots stay referenced (shows in slot_refs)

    def _submit(self, r: _Req, tier: str, kind: str) -> None:
        job = TransferJob(
            next(_job_ids),
            list(r.keys),
            np.asarray(r.slots, dtype=np.int64),
            kind == "load",
            ReqContext(f"r{r.rid}", tenant=r.tenant),
        )
        self.refs[r.slots] += 1
        self.jobs[job.job_id] = (r, tier, kind, time.monotonic())
        r.jobs.add(job.job_id)
        r.phase = "io"
        t = self.tiers[tier]
        (t.submit_load if kind == "load" else t.submit_store)(job)
        self.c[f"{kind}_submitted"] += 1

    def _store(self, r: _Req) -> None:
        """Miss: recompute the blocks (write their content) and store them in every tier."""
        for k, s in zip(r.keys, r.slots):
            self.array[s] = expected(k, self.array.shape[1])
        r.recomputed = True
        for name in self.tiers:
            self._submit(r, name, "store")

    def _result(self, tier: str, res: Any) -> None:
        entry = self.jobs.pop(res.job_id, None)
        if entry is None:
            self.c["double_or_unknown_results"] += 1
            self._error(f"result for job {res.job_id} on {tier}: unknown or reported twice")
            return
        self.reported.add(res.job_id)
        r, _, kind, _ = entry
        self.refs[r.slots] -= 1
        r.jobs.discard(res.job_id)
        if kind == "load":
            ok = set(r.keys) if res.success else set(map(bytes, res.successful_keys or ()))
            for k, s in zip(r.keys, r.slots):
                if k in ok and not np.array_equal(self.array[s], expected(k, self.array.shape[1])):
                    self.c["wrong_blocks"] += 1
                    self._error(f"load from {tier} served a wrong block for {k.hex()[:12]}")
            self.c["load_ok" if res.success else "load_failed"] += 1
            if not res.success and not r.jobs:
                self._store(r)  # the miss falls back to recompute
                return
        else:
            self.c["store_ok" if res.success else "store_failed"] += 1
        if not r.jobs:
            del self.reqs[r.rid]
            self.free.extend(r.slots)
            self.c["requests_done"] += 1

    def _error(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)

    # -- driving -------------------------------------------------------------
    def run(self, seconds: float, drain_s: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()
            time.sleep(0.002)  # not a wait: paces the scheduler-like steps (open-loop traffic)
        return self.drain(drain_s)

    def drain(self, seconds: float = 60.0) -> dict[str, Any]:
        """Stop admitting; step until every request is done (or report what is left)."""
        end = time.monotonic() + seconds
        while self.reqs and time.monotonic() < end:
            self.step(admit=False)
            time.sleep(0.002)  # not a wait: paces the steps that drive the requests to their end
        return self.report()

    def report(self) -> dict[str, Any]:
        return {
            **self.c,
            "unfinished_requests": len(self.reqs),
            "jobs_without_result": len(self.jobs),
            "slot_refs": int(self.refs.sum()),
            "tier_pending": {n: t.jobs.num_pending for n, t in self.tiers.items()},
            "pending_work": {n: bool(t.has_pending_work()) for n, t in self.tiers.items()},
            "errors": list(self.errors),
        }


def assert_clean(rep: dict[str, Any]) -> None:
    """Every job reported once, nothing hung, nothing wrong served, slots free."""
    assert rep.get("wrong_blocks", 0) == 0, rep
    assert rep.get("double_or_unknown_results", 0) == 0, rep
    assert rep.get("job_hangs", 0) == 0 and rep.get("lookup_hangs", 0) == 0, rep
    assert rep["unfinished_requests"] == 0 and rep["jobs_without_result"] == 0, rep
    assert rep["slot_refs"] == 0, rep
    assert all(v == 0 for v in rep["tier_pending"].values()), rep
    assert rep.get("requests_done", 0) > 0, rep


# -- cluster-wide invariants ----------------------------------------------------
def _alive(actor: Any, timeout: float = 5.0) -> bool:
    try:
        ray.get(actor.raykv_ping.remote(), timeout=timeout)
        return True
    except Exception:
        return False


def directory_keys(services: Any, holder_id: str) -> set[int]:
    """What the directory lists for ``holder_id``: its keys' fingerprints (the
    directory keeps fingerprints, not keys; compare with ``fingerprints_of``)."""
    return services.directory.holder_fingerprints(holder_id)


def fingerprints_of(keys: Any) -> set[int]:
    """The directory's fingerprints of ``keys``."""
    from raykv.directory.fingerprint import fingerprints

    return set(fingerprints(list(keys)).tolist())


def holdings(services: Any) -> dict[str, dict[str, Any]]:
    """Per holder id: alive?, its actor's keys and stats (live ones)."""
    out: dict[str, dict[str, Any]] = {}
    for info in services.holders():
        try:
            actor = ray.get_actor(info.actor_name, namespace=info.namespace)
        except ValueError:
            out[info.holder_id] = {"alive": False, "info": info}
            continue
        if not _alive(actor):
            out[info.holder_id] = {"alive": False, "info": info}
            continue
        keys, stats = ray.get([actor.keys.remote(), actor.stats.remote()], timeout=30)
        out[info.holder_id] = {"alive": True, "info": info, "keys": set(keys), "stats": stats.figures}
    return out


def check_invariants(services: Any, block_bytes: int = BLOCK) -> list[str]:
    """Problems found (empty: all good): directory == live holdings, dead
    holders listed nowhere, byte accounting exact and within capacity."""
    from tiers.fs import format as fmt

    problems: list[str] = []
    held = holdings(services)
    listed: set[str] = set()
    for s in services.directory.stats():
        listed |= set(s.holders)
    for hid, h in held.items():
        in_dir = directory_keys(services, hid)
        if not h["alive"]:
            if in_dir or hid in listed:
                problems.append(f"dead holder {hid} still in the directory ({len(in_dir)} keys)")
            continue
        held_fps = fingerprints_of(h["keys"])
        if in_dir != held_fps:
            problems.append(
                f"{hid}: directory lists {len(in_dir)} keys, the actor holds {len(h['keys'])} "
                f"({len(in_dir - held_fps)} stale, {len(held_fps - in_dir)} unlisted)"
            )
        st = h["stats"]
        if h["info"].tier_type == "object_store":
            if st["bytes_used"] != st["blocks"] * block_bytes or st["blocks"] != len(h["keys"]):
                problems.append(f"{hid}: bytes_used {st['bytes_used']} != {st['blocks']} blocks x {block_bytes}")
            if st["bytes_used"] > st["capacity_bytes"]:
                problems.append(f"{hid}: {st['bytes_used']} bytes over capacity {st['capacity_bytes']}")
        elif h["info"].tier_type == "fs":
            root = st["root"]
            sizes = []
            for k in h["keys"]:
                try:
                    sizes.append(os.path.getsize(os.path.join(root, fmt.rel_path(k))))
                except OSError:
                    problems.append(f"{hid}: indexed key {k.hex()[:12]} has no file")
            if st["bytes"] != sum(sizes) or st["files"] != len(h["keys"]):
                problems.append(f"{hid}: stats bytes {st['bytes']} != files on disk {sum(sizes)}")
            if st["capacity_bytes"] and st["bytes"] > st["capacity_bytes"]:
                problems.append(f"{hid}: {st['bytes']} bytes over capacity {st['capacity_bytes']}")
    for hid in listed - set(held):
        problems.append(f"directory lists holder {hid} that the control actor does not know")
    return problems


def wait_invariants(services: Any, timeout: float = 10.0, block_bytes: int = BLOCK) -> list[str]:
    """Invariants may lag a store still finishing in an actor: retry until clean.
    Returns the problems left (empty: clean)."""
    # imported here: this module is pickled by value into Ray workers, which need not import tests/
    from tests.waiting import WaitTimeout, wait_until

    problems: list[str] = []

    def clean() -> bool:
        nonlocal problems
        try:
            problems = check_invariants(services, block_bytes)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            problems = [f"a raykv actor is unavailable (restarting?): {type(e).__name__}"]
        return not problems

    try:
        wait_until(clean, timeout_s=timeout, interval_s=0.2, what="the cluster-wide invariants")
    except WaitTimeout:
        pass  # the caller asserts on the problems left
    return problems
