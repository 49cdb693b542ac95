"""Two Ray nodes share one fs root: a block stored on node A loads on node B."""

from __future__ import annotations

import hashlib

import numpy as np
import ray

import raykv
from raykv.core.contract import LookupResult

BLOCK = 64 * 1024
NAMESPACE = "raykv-fs-2node"


@ray.remote(num_cpus=0)
class Engine:
    """An engine-side fs tier client over its own primary region."""

    def __init__(self, root: str) -> None:
        from raykv.core.factory import TierFactory
        from raykv.engine.primary import PrimaryRegion

        self.region = PrimaryRegion(8, BLOCK)
        services = raykv.attach(NAMESPACE)
        self.tier = TierFactory.create_tier({"type": "fs", "root": root}, self.region.view, services=services)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def store(self, keys: list[bytes], seed: int) -> tuple[bool, list[str]]:
        from raykv.engine.tier_driver import TierDriver

        self.region.array[:] = np.random.default_rng(seed).integers(0, 256, self.region.array.shape, dtype=np.uint8)
        res = TierDriver(self.tier).store(keys, list(range(len(keys))))
        return res.success, [hashlib.sha256(self.region.array[i]).hexdigest() for i in range(len(keys))]

    def load(self, keys: list[bytes]) -> tuple[list[str], bool, list[str]]:
        from raykv.engine.tier_driver import TierDriver

        self.region.array[:] = 0
        # Right after A's store: B's view may not show it yet (replica lag, ~0.1 s), but
        # lookup_blocking asks the directory about every key the view says nobody holds.
        found = [r.name for r in self.tier.lookup_blocking(keys)]
        slots = list(range(len(keys)))[::-1]
        res = TierDriver(self.tier).load(keys, slots)
        return found, res.success, [hashlib.sha256(self.region.array[s]).hexdigest() for s in slots]

    def close(self) -> None:
        self.tier.shutdown()
        self.region.close()


def test_store_on_node_a_load_on_node_b(two_nodes, tmp_path):
    root = str(tmp_path / "shared-kv")  # both "nodes" of this machine see it, like an NFS mount
    a = Engine.options(resources={"node_a": 0.01}).remote(root)
    b = Engine.options(resources={"node_b": 0.01}).remote(root)
    assert ray.get(a.node_id.remote()) != ray.get(b.node_id.remote())

    keys = raykv.prefix_keys(list(range(60)), 10)
    ok, digests = ray.get(a.store.remote(keys, 11))
    assert ok
    found, ok, loaded = ray.get(b.load.remote(keys + raykv.prefix_keys(list(range(7, 27)), 10)[:1]))
    assert found == [LookupResult.HIT.name] * 6 + [LookupResult.MISS.name]
    assert not ok  # the last key was never stored...
    found, ok, loaded = ray.get(b.load.remote(keys))
    assert ok and loaded == digests  # ...the stored ones are byte-identical on node B
    ray.get([a.close.remote(), b.close.remote()])
