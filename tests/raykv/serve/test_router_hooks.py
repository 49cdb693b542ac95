"""``RaykvRequestRouter`` without a Serve app: it stands on Ray's public request-router
API only, falls back to power of two choices through the public mixins' helpers, counts
the requests in flight per replica from Serve's public hooks, reads Serve's queue
figures through the public ``replica_queue_len_cache``, and ranks by the directory.

Serve builds its routers with a ``DeploymentID``, a ``DeploymentHandleSource`` and
``RequestMetadata``, which Ray 2.60 does not export publicly: this test (not the router)
imports them from Serve's private ``common`` module to build the router as Serve does.
(A real Serve LLM app is ``test_router.py``'s.)
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import time
import types
from pathlib import Path
from typing import Any

import pytest

# Private on purpose: Ray 2.60 exports none of these three publicly (ray.serve.request_router
# has ReplicaID and PendingRequest, whose constructors, like the router's, take them). The
# test needs them only to build a router and its requests the way Serve does; router.py
# imports none of them (test_router_reads_no_private_ray_module_or_attribute).
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

import raykv.serve.router as router_module
from raykv.core.identity import KVIdentity
from raykv.core.keys import pending_key
from raykv.core.placement import ENGINE, HolderInfo
from raykv.core.wire import PENDING
from raykv.holders.engine_cache import engine_key
from raykv.integrations.vllm.hashing import block_hashes
from raykv.serve import load_book
from raykv.serve.router import RaykvRequestRouter
from raykv.serve.routing import EngineLayout, request_keys

DEPLOYMENT = DeploymentID(name="LLMServer:tiny", app_name="raykv-routed")
ROUTER_PY = Path(router_module.__file__)
_ids = itertools.count()


class _ActorID:
    def __init__(self, hex_id: str) -> None:
        self._hex = hex_id

    def hex(self) -> str:
        return self._hex


class FakeReplica:
    """What the router and Serve's helpers read of a ``RunningReplica`` (its public attributes)."""

    def __init__(self, name: str, node: str, queue_len: int = 0, models: frozenset[str] = frozenset()) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.node_id = node
        self.actor_id = _ActorID(f"actor-{name}")
        self.availability_zone = None
        self.multiplexed_model_ids = set(models)
        self.max_ongoing_requests = 100
        self.queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _request(prompt: Any = None, model_id: str = "") -> PendingRequest:
    n = next(_ids)
    metadata = RequestMetadata(request_id=f"r{n}", internal_request_id=f"internal-{n}", multiplexed_model_id=model_id)
    return PendingRequest(args=[{"prompt": prompt}] if prompt is not None else [], kwargs={}, metadata=metadata)


def _router(tmp_path: Path, replicas: list[FakeReplica], **init: Any) -> RaykvRequestRouter:
    """A router as Serve makes one (constructor, then ``initialize_state``), given its replicas;
    call inside a running event loop. The tokenizer does not load (token-id prompts only)."""
    router = RaykvRequestRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        use_replica_queue_len_cache=True,
        **init,
    )
    router.initialize_state(model="tiny", tokenizer=str(tmp_path))
    router.update_replicas(replicas)
    return router


def _one_request_served(router: RaykvRequestRouter, replica: FakeReplica) -> None:
    """Serve reports a request routed to ``replica``, then ended: it makes these reports."""
    done = _request()
    router.on_request_routed(done, replica.replica_id, None)
    router.on_request_completed(replica.replica_id, done.metadata.internal_request_id)


async def _probed(router: RaykvRequestRouter, replicas: list[FakeReplica]) -> None:
    """Until Serve's first probe of the new replicas filled its queue cache."""
    for _ in range(200):
        if all(router.replica_queue_len_cache.get(r.replica_id) is not None for r in replicas):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("Serve did not probe the new replicas")


def test_router_reads_no_private_ray_module_or_attribute() -> None:
    """No ``ray._private``/``ray.serve._private`` import; every ``_name`` the router reads
    is its own (assigned or defined in router.py), none of Ray's."""
    tree = ast.parse(ROUTER_PY.read_text())
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert "_private" not in (node.module or ""), node.module
        elif isinstance(node, ast.Import):
            assert not any("_private" in a.name for a in node.names), [a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            assert node.attr in own, f"router.py:{node.lineno} reads {node.attr!r}, which it never sets"
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            assert not (isinstance(name, ast.Constant) and str(name.value).startswith("_")), ast.unparse(node)


def test_router_state_does_not_overwrite_rays(tmp_path: Path) -> None:
    """The attributes the router sets are none of those Ray's base classes set."""

    async def main() -> None:
        router = RaykvRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA)
        rays = set(vars(router))
        router.initialize_state(model="tiny", tokenizer=str(tmp_path))
        ours = set(vars(router)) - rays
        assert {"_sent", "_tags"} <= ours
        tree = ast.parse(ROUTER_PY.read_text())
        assigned = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == "self"
        }
        assert not assigned & rays, sorted(assigned & rays)

    asyncio.run(main())


def test_fallback_picks_two_replicas_by_the_public_mixins(tmp_path: Path) -> None:
    async def main() -> None:
        replicas = [FakeReplica("a", "n1"), FakeReplica("b", "n2"), FakeReplica("c", "n3", models=frozenset({"m"}))]
        router = _router(tmp_path, replicas)
        # No prompt: power of two choices, two distinct replicas of the candidates.
        for _ in range(10):
            (chosen,) = await router.choose_replicas(replicas, _request())
            assert len(chosen) == 2 and len(set(chosen)) == 2 and set(chosen) <= set(replicas)
        assert router.fallbacks == 10 and router.decisions == 0
        # A multiplexed model: the replicas holding it (MultiplexMixin.apply_multiplex_routing).
        assert await router.choose_replicas(replicas, _request(model_id="m")) == [[replicas[2]]]
        # One candidate only (never ranked): it alone.
        assert await router.choose_replicas(replicas[:1], _request([1] * 64)) == [[replicas[0]]]
        # The deployment's name, for the metrics' tags, from the replicas' public ReplicaID.
        assert router._tags == {"deployment": "LLMServer:tiny"}

    asyncio.run(main())


def test_fallback_prefers_this_node_by_the_locality_mixin(tmp_path: Path) -> None:
    async def main() -> None:
        replicas = [FakeReplica("a", "n1"), FakeReplica("b", "n2"), FakeReplica("c", "n3")]
        router = _router(tmp_path, replicas, self_node_id="n2", prefer_local_node_routing=True)
        request = _request()
        assert await router.choose_replicas(replicas, request) == [[replicas[1]]]
        # Tried once: then all of them (LocalityMixin.apply_locality_routing).
        (chosen,) = await router.choose_replicas(replicas, request)
        assert len(set(chosen)) == 2

    asyncio.run(main())


def test_requests_in_flight_counted_from_serves_hooks(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = FakeReplica("a", "n1", queue_len=1), FakeReplica("b", "n2", queue_len=0)
        router = _router(tmp_path, [a, b])
        await _probed(router, [a, b])
        # Serve's cached figures (the public replica_queue_len_cache).
        assert router.queue_lens([a, b]) == {a: 1, b: 0}
        r1, r2, r3 = _request(), _request(), _request()
        for r in (r1, r2, r3):
            router.on_request_routed(r, b.replica_id, None)
        # This router's own count when it is higher (Serve's cache is not updated here).
        assert router.queue_lens([a, b]) == {a: 1, b: 3}
        router.on_request_completed(b.replica_id, r1.metadata.internal_request_id)
        router.on_request_completed(b.replica_id, r2.metadata.internal_request_id)
        assert router.queue_lens([a, b]) == {a: 1, b: 1}
        router.on_request_completed(b.replica_id, r2.metadata.internal_request_id)  # twice: no effect
        assert router.queue_lens([a, b]) == {a: 1, b: 1}
        router.on_request_completed(b.replica_id, r3.metadata.internal_request_id)
        assert router.queue_lens([a, b]) == {a: 1, b: 0}

    asyncio.run(main())


def test_a_request_that_ended_before_its_routing_hook_is_never_counted(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = FakeReplica("a", "n1"), FakeReplica("b", "n2")
        router = _router(tmp_path, [a, b])
        await _probed(router, [a, b])
        # Its completion heard first: the late routing hook counts nothing.
        early = _request()
        router.on_request_completed(a.replica_id, early.metadata.internal_request_id)
        router.on_request_routed(early, a.replica_id, None)
        assert router.queue_lens([a, b]) == {a: 0, b: 0}
        # Rejected by a (its send ends without a routing hook), then accepted by b: counted on b.
        retried = _request()
        router.on_request_completed(a.replica_id, retried.metadata.internal_request_id)
        router.on_request_routed(retried, b.replica_id, None)
        assert router.queue_lens([a, b]) == {a: 0, b: 1}
        router.on_request_completed(b.replica_id, retried.metadata.internal_request_id)
        assert router.queue_lens([a, b]) == {a: 0, b: 0}
        # Bounded memory of such completions.
        for i in range(load_book.EARLY_COMPLETIONS + 10):
            router.on_request_completed(a.replica_id, f"rejected-{i}")
        assert router._sent.inflight.remembered_early == load_book.EARLY_COMPLETIONS

    asyncio.run(main())


class _Remote:
    def __init__(self, value: Any) -> None:
        self.value = value

    async def remote(self) -> Any:
        return self.value


class _Lookup:
    def __init__(self, found: list[list[HolderInfo]]) -> None:
        self.found = found

    async def result_async(self, timeout: float | None = None) -> list[list[HolderInfo]]:
        return self.found


class FakeServices:
    """The raykv services the router uses: the engines' identities and one directory lookup."""

    def __init__(self, identities: dict[str, KVIdentity], holders: dict[bytes, list[HolderInfo]]) -> None:
        self.control = type("Control", (), {"identities": _Remote(identities)})()
        self.holders = holders
        self.directory = self
        # no node view (``directory_agent: false``): the router asks ``directory.lookup_async``
        self.lookup_cache = types.SimpleNamespace(view=None)
        self.config = types.SimpleNamespace(pending_entries=True)

    def lookup_async(self, keys: list[bytes]) -> _Lookup:
        return _Lookup([self.holders.get(k, []) for k in keys])


def test_ranks_by_the_engine_holding_the_prefix_and_skips_it_when_overloaded(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    tag, block = bytes(range(8)), 4
    tokens = list(range(5 * block))
    layout = EngineLayout(tag, block)
    engine_keys, _ = request_keys(block_hashes(tokens, block), layout)
    assert engine_keys[0] == engine_key(tag, block_hashes(tokens, block)[0])

    async def main() -> None:
        a, b, c = FakeReplica("a", "n1"), FakeReplica("b", "n2"), FakeReplica("c", "n3")
        router = _router(tmp_path, [a, b, c], load_weight=0.0)
        await _probed(router, [a, b, c])
        held_by_b = HolderInfo("engine:n2:b", "engine", ENGINE, "raykv-engine-b", "raykv", "n2", b.actor_id.hex())
        identity = KVIdentity(model="tiny", layout={"tokens_per_hash": block, "rank": 0})
        router._book.services = FakeServices({tag.hex(): identity}, {k: [held_by_b] for k in engine_keys[:4]})
        request = _request(tokens)
        ranks = await router.choose_replicas([a, b, c], request)
        assert ranks[0] == [b] and sorted(r.replica_id.unique_id for rank in ranks[1:] for r in rank) == ["a", "c"]
        assert router.decisions == 1 and router.fallbacks == 0
        # every candidate is ranked: when all are full, Serve backs off before asking again
        assert request.routing_context.should_backoff
        # b runs three requests of this router, the others none: ranked last, whatever it holds.
        for _ in range(3):
            router.on_request_routed(_request(), b.replica_id, None)
        ranks = await router.choose_replicas([a, b, c], _request(tokens))
        assert ranks[-1] == [b] and b not in ranks[0]

    asyncio.run(main())


def test_a_burst_sharing_a_new_prefix_goes_where_it_is_being_computed(tmp_path: Path) -> None:
    """Compute once (issue 25): the router counts what a replica computes now as held
    there soon: the prompts it sent there lately, and engines' pending entries."""
    pytest.importorskip("vllm")
    tag, block = bytes(range(8)), 4
    tokens = list(range(1000, 1000 + 6 * block))
    layout = EngineLayout(tag, block)

    async def main() -> None:
        a, b, c = FakeReplica("a", "n1"), FakeReplica("b", "n2"), FakeReplica("c", "n3")
        identity = KVIdentity(model="tiny", layout={"tokens_per_hash": block, "rank": 0})
        # Concurrent decisions (none reported routed yet) for one new prefix follow the
        # first as if it were routed where it ranked first: the second goes there too; the
        # third, with two queued there and none elsewhere, goes elsewhere (it waits for the
        # first's copy there). Sequential decisions do the same (below).
        burst = _router(tmp_path, [a, b, c], load_weight=0.5)
        await _probed(burst, [a, b, c])
        _one_request_served(burst, a)
        burst._book.services = FakeServices({tag.hex(): identity}, {})
        pending = [_request(tokens) for _ in range(3)]  # alive until routed, as in Serve
        firsts = [(await burst.choose_replicas([a, b, c], r))[0] for r in pending]
        x = firsts[0][0]
        assert firsts[1] == [x]
        assert x not in firsts[2]
        router = _router(tmp_path, [a, b, c], load_weight=0.5)
        await _probed(router, [a, b, c])
        router._book.services = FakeServices({tag.hex(): identity}, {})
        # once one is routed, the next ones go there too: the prefix is held there soon,
        # although that replica was given the most new work
        first = _request(tokens)
        ranks = await router.choose_replicas([a, b, c], first)
        chosen = ranks[0][0]
        router.on_request_routed(first, chosen.replica_id, None)
        assert (await router.choose_replicas([a, b, c], _request(tokens)))[0] == [chosen]
        # another router's request computes it on c (its engine's pending entries)
        other = list(range(5000, 5000 + 6 * block))
        _, other_tier = request_keys(block_hashes(other, block), layout)
        on_c = HolderInfo("pending:n3:1", "pending", PENDING, "raykv-pending-c", "raykv", "n3", c.actor_id.hex())
        router._book.services = FakeServices({tag.hex(): identity}, {pending_key(k): [on_c] for k in other_tier})
        assert (await router.choose_replicas([a, b, c], _request(other)))[0] == [c]

    asyncio.run(main())


def test_concurrent_decisions_count_the_requests_decided_before_them(tmp_path: Path) -> None:
    """Requests decided before Serve reports any of them routed (a burst) count in the
    queue of the replica each ranked first: fresh turns that share only a system prompt
    every engine holds spread over the replicas instead of all going to the one their
    shared first block prefers. Serve's report settles each; an unreported one counts
    only ``EXPECTED_S``."""
    pytest.importorskip("vllm")
    tag, block = bytes(range(8)), 4
    system = list(range(7000, 7000 + 2 * block))
    prompts = [system + list(range(100 * i, 100 * i + 3 * block)) for i in range(3)]
    layout = EngineLayout(tag, block)

    async def main() -> None:
        a, b, c = FakeReplica("a", "n1"), FakeReplica("b", "n2"), FakeReplica("c", "n3")
        router = _router(tmp_path, [a, b, c])
        await _probed(router, [a, b, c])
        engines = [
            HolderInfo(
                f"engine:{r.node_id}:{n}", "engine", ENGINE, f"raykv-engine-{n}", "raykv", r.node_id, r.actor_id.hex()
            )
            for r, n in ((a, "a"), (b, "b"), (c, "c"))
        ]
        held, _ = request_keys(block_hashes(system, block), layout)
        identity = KVIdentity(model="tiny", layout={"tokens_per_hash": block, "rank": 0})
        router._book.services = FakeServices({tag.hex(): identity}, {k: engines for k in held})
        _one_request_served(router, a)
        requests = [_request(p) for p in prompts]
        firsts = []
        for r in requests:
            firsts.append((await router.choose_replicas([a, b, c], r))[0][0])
            # Serve counts a request in its queue-length cache once it sends it, before the
            # replica accepts it: counted once, not as sent and as decided
            router.on_send_request(firsts[-1].replica_id)
            assert router.queue_lens([firsts[-1]]) == {firsts[-1]: 1}
        assert len({r.replica_id for r in firsts}) == 3, [r.replica_id.unique_id for r in firsts]
        assert router.queue_lens([a, b, c]) == {a: 1, b: 1, c: 1}
        # Serve reports where each went: counted in flight there instead, not twice
        for r, replica in zip(requests, firsts):
            router.on_request_routed(r, replica.replica_id, None)
        assert router.queue_lens([a, b, c]) == {a: 1, b: 1, c: 1}
        for r, replica in zip(requests, firsts):
            router.on_request_completed(replica.replica_id, r.metadata.internal_request_id)
            router.decrement_queue_len_cache(replica.replica_id)  # as Serve does when it ends
        assert router.queue_lens([a, b, c]) == {a: 0, b: 0, c: 0}
        # a decided request never reported routed counts only a while
        await router.choose_replicas([a, b, c], _request(prompts[0]))
        assert sum(router.queue_lens([a, b, c]).values()) == 1
        assert router._sent.expected.counts(time.monotonic() + load_book.EXPECTED_S + 0.1) == {}

    asyncio.run(main())
