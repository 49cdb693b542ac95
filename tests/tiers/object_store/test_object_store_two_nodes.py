"""Two Ray nodes: blocks stored into node A's plasma load on node B through the
directory (B's actor gets ObjectRefs from A's actor and Ray pulls the objects)."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import ray

import raykv
from raykv.core.contract import LookupResult
from raykv.core.identity import scoped_keys

BLOCK = 512 * 1024
NAMESPACE = "raykv-os-2node"


@ray.remote(num_cpus=0)
class Engine:
    """An engine-side object store tier client over its own primary region."""

    def __init__(self) -> None:
        from raykv.core.factory import TierFactory
        from raykv.engine.primary import PrimaryRegion

        self.region = PrimaryRegion(16, BLOCK)
        services = raykv.attach(NAMESPACE)
        self.tier = TierFactory.create_tier({"type": "object_store"}, self.region.view, services=services)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def store(self, keys: list[bytes], seed: int) -> tuple[bool, list[str]]:
        from raykv.engine.tier_driver import TierDriver

        n = len(keys)
        self.region.array[:n] = np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)
        res = TierDriver(self.tier).store(keys, list(range(n)))
        return res.success, [hashlib.sha256(self.region.array[i]).hexdigest() for i in range(n)]

    def lookup(self, keys: list[bytes], fresh: bool = True) -> list[str]:
        if fresh:
            self.tier.services.lookup_cache.invalidate(scoped_keys(keys))
        return [r.name for r in self.tier.lookup_blocking(keys)]

    def load(self, keys: list[bytes], forget: bool = False) -> tuple[bool, list[bytes], list[str], float]:
        from raykv.engine.tier_driver import TierDriver

        if forget:  # no hint from the lookup cache: the node actor asks the directory
            self.tier.services.lookup_cache.invalidate(scoped_keys(keys))
        self.region.array[:] = 0
        slots = list(range(len(keys)))[::-1]
        t0 = time.perf_counter()
        res = TierDriver(self.tier).load(keys, slots, timeout=30)
        took = time.perf_counter() - t0
        ok = list(res.successful_keys) if res.successful_keys is not None else (list(keys) if res.success else [])
        return res.success, ok, [hashlib.sha256(self.region.array[s]).hexdigest() for s in slots], took

    def stats(self) -> dict:
        return self.tier.stats().figures

    def kill_my_actor(self) -> None:
        ray.kill(self.tier.actor)

    def close(self) -> None:
        self.tier.shutdown()
        self.region.close()


def test_store_on_node_a_load_on_node_b(two_nodes):
    a = Engine.options(resources={"node_a": 0.01}).remote()
    b = Engine.options(resources={"node_b": 0.01}).remote()
    assert ray.get(a.node_id.remote()) != ray.get(b.node_id.remote())

    keys = raykv.prefix_keys(list(range(80)), 10)  # 8 blocks of 512 KiB
    ok, digests = ray.get(a.store.remote(keys, 11))
    assert ok
    never = raykv.prefix_keys(list(range(7, 17)), 10)
    assert ray.get(b.lookup.remote(keys + never)) == [LookupResult.HIT.name] * 8 + [LookupResult.MISS.name]

    # the lookup left A's actor in B's cache: B's actor is told where to pull from
    ok, loaded, got, took = ray.get(b.load.remote(keys))
    assert ok and got == digests
    print(f"cross-node load of {len(keys)} x {BLOCK >> 10} KiB: {took * 1000:.1f} ms")
    # without a hint, B's actor finds A's through the directory; one unknown key fails alone
    ok, loaded, got, _ = ray.get(b.load.remote(keys[:3] + never, forget=True))
    assert not ok and loaded == keys[:3] and got[:3] == digests[:3]

    sa, sb = ray.get([a.stats.remote(), b.stats.remote()])
    assert sb["blocks"] == 0 and sb["counters"]["hits_remote"] == 11  # B pulled, stored nothing
    assert sa["blocks"] == 8 and sa["counters"]["served_remote"] == 11

    # A's actor dies: B's lookups miss and B's loads fail without hanging
    ray.get(a.kill_my_actor.remote())
    t0 = time.monotonic()
    while any(two_nodes.directory.lookup(scoped_keys(keys))):
        assert time.monotonic() - t0 < 1.0
    assert ray.get(b.lookup.remote(keys)) == [LookupResult.MISS.name] * 8
    ok, loaded, _, took = ray.get(b.load.remote(keys[:2], forget=True))
    assert not ok and loaded == [] and took < 10
    ray.get([a.close.remote(), b.close.remote()])
