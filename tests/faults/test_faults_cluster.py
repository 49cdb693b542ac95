"""Faults injected into a running workload on a real multi-node Ray cluster.

Each test runs engines (actors driving real tiers the way a scheduler does,
``harness.Workload``) and, mid-workload, removes a node, kills a tier actor,
kills a directory shard or kills an engine during a store. Each then asserts:
no request failed or hung (misses fell back to recompute), every job ended in
exactly one JobResult, primary-slot refcounts are back to zero, no wrong
block was served, the directory dropped the dead holder's entries within 1 s
of Ray reporting the death (measured and printed), and the directory and the
tier actors' byte accounting agree exactly afterwards.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import raykv  # noqa: E402
from raykv.core import naming  # noqa: E402
from raykv.core.identity import scoped_keys
from raykv.directory.messages import ShardStats
from tests.waiting import WaitTimeout, wait_until  # noqa: E402

ray.cloudpickle.register_pickle_by_value(harness)

NS = "raykv-faults"
MiB = 1 << 20
OS_CAPACITY = 3 * MiB  # 48 blocks per node: the workload evicts
FS_CAPACITY = 6 * MiB


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, make_ray_cluster):
    c, _ = make_ray_cluster(head={"num_cpus": 2, "resources": {"head": 1}, "object_store_memory": 150 * MiB})
    services = raykv.start({"namespace": NS, "directory_shards": 2})
    root = str(tmp_path_factory.mktemp("faults") / "kv")
    yield c, services, root
    services.shutdown()


@ray.remote(num_cpus=0, max_restarts=0)
class Engine:
    """One engine process: a primary region and the object_store (+ fs) tiers."""

    def __init__(self, root: str | None, chunks: int = 32, seed: int = 0, keyspace: int = 48) -> None:
        from raykv.core.factory import TierFactory
        from raykv.engine.primary import PrimaryRegion

        self.region = PrimaryRegion(chunks, harness.BLOCK)
        services = raykv.attach(NS)
        tiers = {
            "object_store": TierFactory.create_tier(
                {"type": "object_store", "capacity_bytes": OS_CAPACITY, "job_timeout_s": 20.0},
                self.region.view,
                services=services,
            )
        }
        if root:
            tiers["fs"] = TierFactory.create_tier(
                {"type": "fs", "root": root, "capacity_bytes": FS_CAPACITY, "fsync": False, "control_timeout_s": 10.0},
                self.region.view,
                services=services,
            )
        self.tiers = tiers
        self.work = harness.Workload(tiers, self.region.array, keyspace=keyspace, seed=seed)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, seconds: float) -> dict:
        return self.work.run(seconds)

    def store(self, prefixes: list[int]) -> bool:
        """Store whole prefixes in every tier (set-up)."""
        from raykv.engine.tier_driver import TierDriver

        keys = [k for i in prefixes for k in harness.request_keys(i)]
        for j, k in enumerate(keys):
            self.region.array[j] = harness.expected(k)
        return all(TierDriver(t).store(keys, list(range(len(keys)))).success for t in self.tiers.values())

    def store_and_die(self, delay_s: float) -> None:
        """Submit a store of every slot to every tier, then crash mid-store."""
        import numpy as np

        from raykv.core.contract import ReqContext, TransferJob

        keys = [
            k
            for i in range(1000, 1000 + self.region.num_chunks // harness.BLOCKS_PER_REQ)
            for k in harness.request_keys(i)
        ]
        for j, k in enumerate(keys):
            self.region.array[j] = harness.expected(k)
        for n, t in enumerate(self.tiers.values()):
            t.submit_store(TransferJob(900 + n, keys, np.arange(len(keys)), False, ReqContext("doomed")))
        time.sleep(delay_s)  # not a wait: the crash lands this far into the store (the parameter under test)
        os._exit(1)

    def shm_path(self) -> str:
        return self.region.path

    def close(self) -> None:
        for t in self.tiers.values():
            t.shutdown()


def _engine(where: dict, root: str | None, **kw) -> "ray.actor.ActorHandle":
    e = Engine.options(resources=where).remote(root, **kw)
    ray.get(e.node_id.remote(), timeout=120)
    return e


def _dropped_at(services, holder_id: str, after: float) -> list[float]:
    """Wall times at which each shard dropped ``holder_id`` (after ``after``)."""
    out = []
    for s in services.directory.stats():
        ts = [d.at for d in s.dropped if d.holder_id == holder_id and d.at >= after]
        if ts:
            out.append(min(ts))
    return out


def _assert_invariants(services) -> None:
    problems = harness.wait_invariants(services)
    assert not problems, problems


def _clean_then_found_again(services, root: str, eng, work, seed: int) -> None:
    """``work`` (``eng``'s workload, hit by a fault) ended clean with exact books; a
    second workload (``seed``) ends clean and finds blocks the first stored. Closes both."""
    rep = ray.get(work, timeout=120)
    print("workload:", {k: v for k, v in rep.items() if k != "errors"})
    harness.assert_clean(rep)
    _assert_invariants(services)
    eng2 = _engine({"head": 0.01}, root, seed=seed)
    rep2 = ray.get(eng2.run.remote(2.0), timeout=120)
    harness.assert_clean(rep2)
    assert rep2.get("hit_object_store", 0) + rep2.get("hit_fs", 0) > 0, rep2
    for e in (eng, eng2):
        ray.get(e.close.remote())
        ray.kill(e)


# -- node loss ---------------------------------------------------------------------
def test_node_loss_mid_workload(cluster):
    c, services, root = cluster
    node_b = c.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=150 * MiB)
    c.wait_for_nodes()
    eng_b = _engine({"node_b": 0.01}, None, keyspace=8)
    assert ray.get(eng_b.store.remote(list(range(8))))  # node B's plasma holds 32 blocks
    b_node = ray.get(eng_b.node_id.remote())
    b_holder = f"object_store:{b_node}"
    b_actor = ray.get_actor(naming.object_store_actor(b_node), namespace=NS)
    b_keys = ray.get(b_actor.keys.remote())
    assert len(b_keys) == 32 and harness.directory_keys(services, b_holder) == harness.fingerprints_of(b_keys)

    eng_a = _engine({"head": 0.01}, None, keyspace=8, seed=1)
    work = eng_a.run.remote(8.0)  # loads pull B's blocks across nodes
    time.sleep(2.5)  # not a wait: the fault lands mid-workload, 2.5 s into its 8 s
    watch = b_actor.raykv_watch.remote()
    t_kill = time.monotonic()
    wall_kill = time.time()
    c.remove_node(node_b)
    t_ray = t_clear = wall_ray = None

    def reported_and_cleared() -> bool:
        nonlocal t_ray, t_clear, wall_ray
        now = time.monotonic()
        if t_ray is None and ray.wait([watch], timeout=0)[0]:
            t_ray, wall_ray = now, time.time()
        if t_clear is None:
            found = services.directory.lookup(list(b_keys))
            if not any(h.holder_id == b_holder for hs in found for h in hs):
                t_clear = now
        return t_ray is not None and t_clear is not None

    wait_until(
        reported_and_cleared,
        timeout_s=30,
        interval_s=0.002,
        what="node death reported by Ray and its entries dropped from the directory",
    )
    shard_drop = max(_dropped_at(services, b_holder, wall_kill))
    print(
        f"\nnode loss: Ray reported the death {1000 * (t_ray - t_kill):.0f} ms after remove_node; "
        f"shards dropped the node's entries {1000 * (shard_drop - wall_ray):+.0f} ms from Ray's report; "
        f"a lookup saw them gone {1000 * (t_clear - t_ray):+.0f} ms from it"
    )
    assert shard_drop - wall_ray < 1.0 and t_clear - t_ray < 1.0

    rep = ray.get(work, timeout=120)
    print("workload:", {k: v for k, v in rep.items() if k != "errors"})
    harness.assert_clean(rep)
    assert rep.get("hit_object_store", 0) > 0 and rep.get("load_failed", 0) + rep.get("load_ok", 0) > 0
    _assert_invariants(services)
    ray.get(eng_a.close.remote())
    ray.kill(eng_a)


# -- tier actor kill ---------------------------------------------------------------------
@pytest.mark.parametrize("which", ["object_store", "fs"])
def test_tier_actor_killed_mid_workload(cluster, which):
    c, services, root = cluster
    eng = _engine({"head": 0.01}, root, seed=2)
    work = eng.run.remote(7.0)
    time.sleep(2.5)  # not a wait: the fault lands mid-workload, 2.5 s into its 7 s
    head = ray.get(eng.node_id.remote())
    name = naming.object_store_actor(head) if which == "object_store" else naming.fs_actor(root)
    actor = ray.get_actor(name, namespace=NS)
    holder = next(h.holder_id for h in services.holders() if h.actor_name == name)
    watch = actor.raykv_watch.remote()
    wall_kill = time.time()
    t_kill = time.monotonic()
    ray.kill(actor, no_restart=False)  # a crash: Ray restarts it
    ray.wait([watch], timeout=30)
    t_ray, wall_ray = time.monotonic(), time.time()
    try:
        wait_until(
            lambda: len(_dropped_at(services, holder, wall_kill)) >= services.directory.num_shards,
            timeout_s=t_kill + 10 - time.monotonic(),  # 10 s from the kill
            interval_s=0.005,
            what=f"every shard to drop the killed {holder}",
        )
    except WaitTimeout:
        stats = services.directory.stats()
        pytest.fail(
            f"entries of the killed {holder} not dropped: {[s.dropped for s in stats]} {[s.holders for s in stats]}"
        )
    shard_drop = max(_dropped_at(services, holder, wall_kill))
    print(
        f"\n{which} actor kill: Ray reported it {1000 * (t_ray - t_kill):.0f} ms after the kill; "
        f"every shard dropped its entries {1000 * (shard_drop - wall_ray):+.0f} ms from Ray's report"
    )
    assert shard_drop - wall_ray < 1.0
    rep = ray.get(work, timeout=120)
    print("workload:", {k: v for k, v in rep.items() if k != "errors"})
    harness.assert_clean(rep)
    _assert_invariants(services)
    ray.get(eng.close.remote())
    ray.kill(eng)


# -- directory shard kill -----------------------------------------------------------------
def test_directory_shard_killed_mid_workload_rebuilds(cluster):
    c, services, root = cluster
    eng = _engine({"head": 0.01}, root, seed=3)
    work = eng.run.remote(7.0)
    time.sleep(2.5)  # not a wait: the fault lands mid-workload, 2.5 s into its 7 s
    shard = services.directory.shards[0]
    before = ray.get(shard.stats.remote())
    agent = ray.get_actor(naming.directory_agent(ray.get(eng.node_id.remote())), namespace=NS)
    agent_before = ray.get(agent.stats.remote())
    t0 = time.monotonic()
    ray.kill(shard, no_restart=False)
    # ray.kill is asynchronous: a call sent right after it may still reach the
    # old instance, and the first calls may find the new one restarting.

    def restarted() -> ShardStats | None:
        after = ray.get(shard.stats.remote(), timeout=60)  # waits for the restart and its rebuild
        return after if after.started_at > before.started_at else None

    after = wait_until(
        restarted,
        timeout_s=60,
        interval_s=0.01,
        ignore=(ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError),
        what="the shard to restart (a newer started_at)",
    )
    took = time.monotonic() - t0
    rb = after.rebuild
    print(
        f"\nshard restart + rebuild: {1000 * took:.0f} ms after the kill; rebuild itself "
        f"{1000 * rb.seconds:.0f} ms, {rb.keys} keys from {rb.holders} holders (had {before.keys})"
    )
    assert rb.holders >= 2 and rb.keys > 0 and not rb.error
    # the node's agent could not follow the shard through its restart: its view dropped
    # what it knew (a stale entry would name blocks the new shard no longer lists)
    agent_after = wait_until(
        lambda: (lambda s: s if s.resets > agent_before.resets else None)(ray.get(agent.stats.remote())),
        timeout_s=30,
        what="the agent's view to be reset after the shard restart",
    )
    assert agent_after.gaps > agent_before.gaps
    # a second workload finds what the first stored, through the rebuilt shard
    _clean_then_found_again(services, root, eng, work, seed=4)


# -- directory agent kill -----------------------------------------------------------------
def test_directory_agent_killed_mid_workload(cluster):
    """The node's agent crashes mid-workload: Ray restarts it, its view is rebuilt
    from the feeds, and meanwhile lookups miss (never hang, never wrong bytes)."""
    c, services, root = cluster
    eng = _engine({"head": 0.01}, root, seed=6)
    work = eng.run.remote(7.0)
    time.sleep(2.5)  # not a wait: the fault lands mid-workload, 2.5 s into its 7 s
    agent = ray.get_actor(naming.directory_agent(ray.get(eng.node_id.remote())), namespace=NS)
    before = ray.get(agent.stats.remote())
    assert before.lookups > 0  # the workload's lookups went through it
    t0 = time.monotonic()
    ray.kill(agent, no_restart=False)
    wait_until(
        lambda: (lambda s: s if s.started_at > before.started_at else None)(ray.get(agent.stats.remote(), timeout=30)),
        timeout_s=60,
        interval_s=0.01,
        ignore=(ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError),
        what="the agent to restart (a newer started_at)",
    )
    print(f"\nagent restart: {1000 * (time.monotonic() - t0):.0f} ms after the kill")
    # the restarted agent serves a second workload, which finds what the first stored
    _clean_then_found_again(services, root, eng, work, seed=6)
    assert ray.get(agent.stats.remote()).lookups > 0  # the restarted agent took its lookups


# -- engine killed during a store ------------------------------------------------------------
@pytest.mark.parametrize("delay_s", [0.0, 0.1])
def test_engine_killed_during_store(cluster, delay_s):
    c, services, root = cluster
    eng = _engine({"head": 0.01}, root, chunks=40)  # 2.5 MiB: fits the object store capacity
    shm = ray.get(eng.shm_path.remote())
    os_actor = ray.get_actor(naming.object_store_actor(ray.get(eng.node_id.remote())), namespace=NS)
    calls = ray.get(os_actor.stats.remote()).figures["counters"].get("store_calls", 0)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(eng.store_and_die.remote(delay_s), timeout=60)
    # the tier actors finish or drop the orphaned store on their own; then all agrees
    _assert_invariants(services)
    # whatever the directory lists loads back intact on another engine (never a partial block)
    keys = [k for i in range(1000, 1010) for k in harness.request_keys(i)]
    listed = [k for k, hs in zip(keys, services.directory.lookup(scoped_keys(keys))) if hs]
    reader = _engine({"head": 0.01}, root, seed=5, keyspace=1)
    rep = ray.get(reader.run.remote(0.5), timeout=60)
    harness.assert_clean(rep)
    ok = ray.get(reader.__ray_call__.remote(_load_and_check, listed), timeout=60)
    calls = ray.get(os_actor.stats.remote()).figures["counters"].get("store_calls", 0) - calls
    tmp = [n for _, _, fs in os.walk(root) for n in fs if n.endswith(".tmp")]
    print(f"\nstore calls that reached the object store actor: {calls}; temp files left: {len(tmp)}")
    print(
        f"\nengine killed {1000 * delay_s:.0f} ms into a store of {len(keys)} blocks x 2 tiers: "
        f"{len(listed)} keys listed afterwards, {ok} loaded back intact; /dev/shm region left: {os.path.exists(shm)}"
    )
    assert ok == len(listed)
    assert not os.path.exists(shm), "a killed engine left its primary region in /dev/shm"
    ray.get(reader.close.remote())
    ray.kill(reader)


def _load_and_check(self, keys: list[bytes]) -> int:
    """Inside an Engine: load ``keys`` (from whichever tier holds them) and verify."""
    from raykv.core.contract import LookupResult
    from raykv.engine.tier_driver import TierDriver

    good = 0
    for i in range(0, len(keys), 16):
        part = keys[i : i + 16]
        for name, t in self.tiers.items():
            here = [k for k, r in zip(part, t.lookup_blocking(part)) if r == LookupResult.HIT]
            if not here:
                continue
            res = TierDriver(t).load(here, list(range(len(here))))
            ok = set(here) if res.success else set(map(bytes, res.successful_keys or ()))
            for j, k in enumerate(here):
                if k in ok:
                    assert (self.region.array[j] == harness.expected(k)).all(), f"wrong block from {name}"
            part = [k for k in part if k not in ok]
            good += len(ok)
        # keys listed but not loadable must now miss (dropped as they failed)
    return good
