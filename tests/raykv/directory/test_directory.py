"""The directory on a real local Ray: batched register/lookup, holder death."""

from __future__ import annotations

import time

import ray

from raykv.core.keys import prefix_keys
from raykv.core.placement import PLASMA, SHARED, HolderInfo
from raykv.holders.holder_actor import WatchableActor
from tests.waiting import wait_until


@ray.remote(num_cpus=0)
class FakeHolder(WatchableActor):
    """A holder actor with nothing in it but the watch method."""


def _holder(services, name: str, medium: str = PLASMA, node_id: str | None = None):
    actor = FakeHolder.options(name=name, namespace=services.namespace).remote()
    info = HolderInfo(name, "object_store" if medium == PLASMA else "fs", medium, name, services.namespace, node_id)
    ray.get(services.directory.add_holder(info, actor))
    return info, actor


def test_register_lookup_unregister(raykv_services):
    d = raykv_services.directory
    info, _ = _holder(raykv_services, "h-basic")
    keys = prefix_keys(list(range(640)), 64)
    ray.get(d.register(info.holder_id, keys[:6]))
    found = d.lookup(keys)
    assert [bool(h) for h in found] == [True] * 6 + [False] * 4
    assert found[0] == [info]
    ray.get(d.unregister(info.holder_id, keys[:2]))
    assert [bool(h) for h in d.lookup(keys[:3])] == [False, False, True]


def test_prefix_lookup_prefers_local_then_shared(raykv_services):
    d = raykv_services.directory
    local, _ = _holder(raykv_services, "h-local", PLASMA, "node-a")
    remote, _ = _holder(raykv_services, "h-remote", PLASMA, "node-b")
    shared, _ = _holder(raykv_services, "h-shared", SHARED)
    keys = prefix_keys(list(range(1000, 1500)), 50)  # 10 keys
    ray.get(d.register(remote.holder_id, keys[:8]))
    ray.get(d.register(shared.holder_id, keys[:5]))
    ray.get(d.register(local.holder_id, keys[:2]))
    hit = d.prefix_lookup(keys, node_id="node-a")
    assert hit.num_keys == 8
    assert hit.holders[:2] == [local, local]
    assert hit.holders[2:5] == [shared] * 3
    assert hit.holders[5:] == [remote] * 3


def test_holder_death_drops_entries_fast(raykv_services):
    d = raykv_services.directory
    info, actor = _holder(raykv_services, "h-doomed")
    keys = prefix_keys(list(range(2000, 4000)), 10)
    ray.get(d.register(info.holder_id, keys))
    assert all(d.lookup(keys))
    ray.kill(actor)
    t0 = time.monotonic()
    wait_until(
        lambda: not any(d.lookup(keys)), timeout_s=1.0, interval_s=0.01, what="the dead holder's entries to go (1 s)"
    )
    elapsed = time.monotonic() - t0
    print(f"invalidation after actor kill: {elapsed * 1000:.1f} ms")
    stats = d.stats()
    assert all("h-doomed" not in s.holders for s in stats)


def test_lookup_cache_batches_one_call_per_shard(raykv_services):
    d = raykv_services.directory
    info, _ = _holder(raykv_services, "h-cache")
    keys = prefix_keys(list(range(5000, 5640)), 64)
    ray.get(d.register(info.holder_id, keys[:4]))
    cache = raykv_services.lookup_cache
    before = sum(s.calls.get("lookup", 0) for s in d.stats())
    for k in keys:
        assert cache.get(k) is None
        cache.request(k)
    cache.wait()
    after = sum(s.calls.get("lookup", 0) for s in d.stats())
    assert after - before <= d.num_shards
    assert [bool(cache.get(k)) for k in keys] == [True] * 4 + [False] * 6
