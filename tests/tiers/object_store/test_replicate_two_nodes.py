"""Two Ray nodes: ``replicate`` copies the blocks node A's object store actor
holds pinned into node B's (registered, pinned, within B's capacity, pin cap
and tenants), after which B's loads are served from B's own plasma; and
``raykv warm --all-nodes`` (``warm(all_nodes=True)``) against a stub app whose
"replica" stores on node A ends with a copy on node B; and a request with a TTL
on node B, whose blocks it loaded from node A, extends node A's pins."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.contract import ReqContext
from raykv.core.pins import TIER_CAP
from raykv.ops import warm
from raykv.ops.pin_watch import Settling
from raykv.services.cluster import RaykvServices
from tests.waiting import wait_until
from tiers.object_store.messages import ReplicateAnswer

BLOCK = 512 * 1024
NAMESPACE = "raykv-os-replicate"
TTL = 600.0
#: Node B's tier: 12 blocks, at most 6 of them pinned, packs of 2 blocks (pins take whole packs).
B_OPTIONS = {"capacity_bytes": 12 * BLOCK, "max_pack_bytes": 2 * BLOCK}


@ray.remote(num_cpus=0)
class Engine:
    """An engine-side object store tier client over its own primary region."""

    def __init__(self, options: dict[str, Any]) -> None:
        from raykv.core.factory import TierFactory
        from raykv.engine.primary import PrimaryRegion

        self.region = PrimaryRegion(16, BLOCK)
        services = raykv.attach(NAMESPACE)
        self.tier = TierFactory.create_tier({"type": "object_store", **options}, self.region.view, services=services)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def _driver(self, tenant: str | None, ttl: float | None) -> Any:
        from raykv.engine.tier_driver import TierDriver

        driver = TierDriver(self.tier, "replicate-test")
        driver.req = ReqContext("replicate-test", tenant=tenant, cache_ttl_s=ttl)
        return driver

    def store(self, keys: list[bytes], seed: int, tenant: str | None, ttl: float | None) -> list[str]:
        n = len(keys)
        self.region.array[:n] = np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)
        res = self._driver(tenant, ttl).store(keys, list(range(n)))
        assert res.success, res
        return [hashlib.sha256(self.region.array[i]).hexdigest() for i in range(n)]

    def load(self, keys: list[bytes], tenant: str | None) -> tuple[bool, list[str]]:
        self.region.array[:] = 0
        slots = list(range(len(keys)))[::-1]
        res = self._driver(tenant, None).load(keys, slots, timeout=30)
        return res.success, [hashlib.sha256(self.region.array[s]).hexdigest() for s in slots]

    def pin(self, keys: list[bytes], tenant: str | None, ttl: float) -> None:
        """What a request with ``cache_ttl_s`` does at the end of its first step (``pin_renewal``)."""
        self.tier.touch(keys, ReqContext("replicate-test", tenant=tenant, cache_ttl_s=ttl))
        self.tier.on_schedule_end()

    def close(self) -> None:
        self.tier.shutdown()
        self.region.close()


class Nodes:
    """The engines and object store actors of node A and node B."""

    def __init__(self, services: RaykvServices) -> None:
        self.services = services
        self.a = Engine.options(resources={"node_a": 0.01}).remote({})
        self.b = Engine.options(resources={"node_b": 0.01}).remote(B_OPTIONS)
        self.node_a, self.node_b = ray.get([self.a.node_id.remote(), self.b.node_id.remote()])
        assert self.node_a != self.node_b
        self.actor_a = ray.get_actor(naming.object_store_actor(self.node_a), namespace=NAMESPACE)
        self.actor_b = ray.get_actor(naming.object_store_actor(self.node_b), namespace=NAMESPACE)

    def figures(self, actor: Any) -> dict[str, Any]:
        return ray.get(actor.stats.remote()).figures

    def replicate(self, keys: list[bytes], tenant: str, ttl: float | None) -> ReplicateAnswer:
        answer = ray.get(self.actor_b.replicate.remote(keys, tenant, ttl), timeout=60)
        assert isinstance(answer, ReplicateAnswer)
        return answer

    def holder_ids(self, keys: list[bytes]) -> list[set[str]]:
        return [{h.holder_id for h in hs} for hs in self.services.directory.lookup(keys)]


@pytest.fixture(scope="module")
def nodes(two_nodes) -> Iterator[Nodes]:
    n = Nodes(two_nodes)
    yield n
    ray.get([n.a.close.remote(), n.b.close.remote()])


def test_replicate_copies_registers_and_pins_within_the_pin_cap(nodes: Nodes) -> None:
    raw = raykv.prefix_keys(list(range(80)), 10)  # 8 blocks of 512 KiB
    digests = ray.get(nodes.a.store.remote(raw, 11, "agents", TTL))
    # A holds them pinned for the tenant, as scoped keys (what warm sends to every node)
    keys = ray.get(nodes.actor_a.pinned_keys.remote("agents", TTL - 60))
    assert len(keys) == 8 and set(keys) == set(ray.get(nodes.actor_a.keys.remote()))
    assert ray.get(nodes.actor_a.pinned_keys.remote("agents", TTL + 60)) == []
    assert ray.get(nodes.actor_a.pinned_keys.remote("someone-else", 0.0)) == []
    unknown = bytes(len(keys[0]))

    answer = nodes.replicate([*keys, unknown, keys[0]], "agents", TTL)
    # 4 packs of 2 blocks: 3 pinned (6 blocks = half of B's capacity), the 4th refused whole
    assert answer == ReplicateAnswer(
        nodes.node_b, copied=8, copied_bytes=8 * BLOCK, held=0, not_found=1, pinned=6, pins_refused={TIER_CAP: 2}
    )
    assert answer.refused == 2
    b = nodes.figures(nodes.actor_b)
    assert b["blocks"] == 8 and b["packs"] == 4 and b["tenant_bytes"] == {"agents": 8 * BLOCK}
    assert b["pinned_blocks"] == 6 and b["tenant_pinned_bytes"] == {"agents": 6 * BLOCK}
    assert b["counters"]["pins_refused_tier_cap"] == 2 and b["counters"]["replicated_blocks"] == 8
    holders = {f"object_store:{nodes.node_a}", f"object_store:{nodes.node_b}"}
    wait_until(lambda: nodes.holder_ids(keys) == [holders] * 8, timeout_s=10, what="B registered at the directory")

    # again: every key is held, pins extended; the unpinned pack is refused again
    again = nodes.replicate(keys, "agents", TTL)
    assert (again.copied, again.held, again.not_found, again.pinned, again.pins_refused) == (0, 8, 0, 6, {TIER_CAP: 2})

    # B's engine loads the prefix from B's own plasma, not from A's
    served_by_a = nodes.figures(nodes.actor_a)["counters"]["served_remote"]
    ok, got = ray.get(nodes.b.load.remote(raw, "agents"))
    assert ok and got == digests
    counters = nodes.figures(nodes.actor_b)["counters"]
    assert counters["hits"] == 8 and counters.get("hits_remote", 0) == 0
    assert nodes.figures(nodes.actor_a)["counters"]["served_remote"] == served_by_a
    # another tenant's request does not find them (the keys are scoped by tenant)
    ok, _ = ray.get(nodes.b.load.remote(raw, "intruder"))
    assert not ok


def test_replicate_evicts_lru_for_room_and_refuses_more_than_the_capacity(nodes: Nodes) -> None:
    raw = raykv.prefix_keys(list(range(1000, 1060)), 10)  # 6 blocks
    ray.get(nodes.a.store.remote(raw, 12, "t2", TTL))
    keys = ray.get(nodes.actor_a.pinned_keys.remote("t2", 0.0))
    evicted = nodes.figures(nodes.actor_b)["counters"].get("evicted_blocks", 0)
    # B holds 8 (6 pinned): 6 more evict the unpinned pack of 2 (LRU; pinned ones stay)
    answer = nodes.replicate(keys, "t2", None)
    assert (answer.copied, answer.not_stored, answer.pinned, answer.error) == (6, 0, 0, None)
    b = nodes.figures(nodes.actor_b)
    assert b["counters"]["evicted_blocks"] == evicted + 2
    assert b["tenant_bytes"] == {"agents": 6 * BLOCK, "t2": 6 * BLOCK} and b["pinned_blocks"] == 6

    big = raykv.prefix_keys(list(range(2000, 2140)), 10)  # 14 blocks: more than B's whole capacity
    ray.get(nodes.a.store.remote(big, 13, "big", TTL))
    big_keys = ray.get(nodes.actor_a.pinned_keys.remote("big", 0.0))
    assert len(big_keys) == 14
    answer = nodes.replicate(big_keys, "big", TTL)
    assert (answer.copied, answer.not_stored, answer.held, answer.not_found) == (0, 14, 0, 0)
    assert answer.error is not None and "capacity" in answer.error
    b = nodes.figures(nodes.actor_b)
    assert b["counters"]["store_too_big"] == 1 and "big" not in b["tenant_bytes"]


# -- raykv warm --all-nodes -------------------------------------------------------------


class ReplicaOnNodeA(BaseHTTPRequestHandler):
    """/v1/models lists "tiny"; /v1/completions stores the prompt's blocks on node A
    (as the replica that computed it would: its tenant, pinned for its TTL)."""

    engine: Any = None
    stored: list[list[bytes]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"data": [{"id": "tiny"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        params = body["kv_transfer_params"]
        keys = raykv.prefix_keys(body["prompt"], 10)
        ray.get(self.engine.store.remote(keys, len(self.stored), params.get("tenant"), params["cache_ttl_s"]))
        self.stored.append(keys)
        self._answer({"usage": {"prompt_tokens": len(body["prompt"])}})


@pytest.fixture
def app_on_node_a(nodes: Nodes) -> Iterator[str]:
    ReplicaOnNodeA.engine, ReplicaOnNodeA.stored = nodes.a, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ReplicaOnNodeA)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_warm_all_nodes_puts_a_copy_on_every_node(nodes: Nodes, app_on_node_a: str) -> None:
    nodes.services.unpin(everything=True)  # room for new pins on B
    prompt = list(range(5000, 5040))  # 4 blocks
    settling = Settling(settle_s=0.5, quiet_s=10.0, limit_s=30.0, interval_s=0.1)
    out = warm.warm(nodes.services, [prompt], TTL, url=app_on_node_a, tenant="team", settling=settling, all_nodes=True)
    assert out.pinned[f"object_store:{nodes.node_a}"].blocks == 4
    r = out.replicated
    assert r is not None and r.keys == 4 and r.errors == {}
    assert (r.per_node[nodes.node_b].copied, r.per_node[nodes.node_b].pinned) == (4, 4)
    assert (r.per_node[nodes.node_a].copied, r.per_node[nodes.node_a].held) == (0, 4)
    report = out.report()
    assert json.loads(json.dumps(report)) == report and report["all_nodes"]["blocks_copied"] == 4
    assert f"node {nodes.node_b[:12]}: copied 4 (2.0 MiB), already there 0" in out.format()
    assert nodes.figures(nodes.actor_b)["tenant_pinned_bytes"] == {"team": 4 * BLOCK}


def test_a_ttl_request_on_node_b_extends_the_pins_of_node_as_copy(nodes: Nodes) -> None:
    raw = raykv.prefix_keys(list(range(3000, 3020)), 10)  # 2 blocks, pinned on node A for 30 s
    digests = ray.get(nodes.a.store.remote(raw, 14, "relay", 30.0))
    keys = ray.get(nodes.actor_a.pinned_keys.remote("relay", 0.0))
    assert len(keys) == 2 and ray.get(nodes.actor_a.pinned_keys.remote("relay", 60.0)) == []
    # node B's engine loads them (pulled from A: B stores no copy), and its request asks for 900 s
    ok, got = ray.get(nodes.b.load.remote(raw, "relay"))
    assert ok and got == digests
    assert ray.get(nodes.actor_b.holds.remote(keys)) == [False, False]
    relayed = nodes.figures(nodes.actor_b)["counters"].get("pins_relayed", 0)
    ray.get(nodes.b.pin.remote(raw, "relay", 900.0))
    wait_until(
        lambda: len(ray.get(nodes.actor_a.pinned_keys.remote("relay", 800.0))) == 2,
        timeout_s=30,
        what="node B's pins relayed to node A's actor",
    )
    assert nodes.figures(nodes.actor_b)["counters"]["pins_relayed"] == relayed + 2
    assert ray.get(nodes.actor_b.holds.remote(keys)) == [False, False]  # a pin copies nothing
