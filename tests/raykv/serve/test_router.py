"""The raykv request router on a real Ray Serve LLM app (tiny model, CPU vLLM) over a
three-node ``ray.cluster_utils.Cluster``, at most one replica per node: each engine
registers its own node and stores through that node's object store actor, follow-up
turns go to the replica whose engine holds their prefix, an overloaded replica is
skipped and taken again once its requests are cancelled, a killed replica's engine
entries leave the directory at once and routing never picks it again, and a replica
added to the running app (``num_replicas`` raised through Serve's external scaling
REST API, the dashboard's ``/scale`` endpoint) gets its first request's prefix
from raykv. The head runs Ray's dashboard: it serves that endpoint and Ray's state
API, through which the test finds the replicas' actors and their nodes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import requests
from ray.cluster_utils import Cluster

import raykv
from raykv.core import naming
from raykv.core.placement import ENGINE, HolderInfo
from raykv.demo.tiny_model import make_prompt_tokens
from raykv.integrations.vllm.hashing import block_hashes
from raykv.ops.status import collect_status
from raykv.serve.routing import EngineLayout, request_keys
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serve]

NAMESPACE = "raykv-router-test"
MODEL_ID = "tiny"
URL = "http://127.0.0.1:8000/v1/completions"
MIB = 1 << 20
BLOCK = 128
TURN = 5 * BLOCK  # a session's first turn: 5 full blocks


@pytest.fixture(scope="module")
def routed_app(vllm_env, tiny_model, tmp_path_factory, free_port) -> Iterator[dict[str, Any]]:
    pytest.importorskip("ray.serve.llm")
    from ray import serve

    if ray.is_initialized():
        ray.shutdown()
    # One llm_slot per node: two replicas always run on two simulated nodes; the
    # third slot takes the replacement of a killed replica while its old one goes.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8,  # logical: a replica (2 CPUs in Serve LLM) and the ingress
            "object_store_memory": 256 * MIB,
            "include_dashboard": True,  # Serve's scaling REST API and Ray's state API
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
            "resources": {"llm_slot": 1},
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=4, object_store_memory=256 * MIB, resources={"llm_slot": 1})
    ctx = ray.init(address=cluster.address, log_to_driver=False)
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
    root = str(tmp_path_factory.mktemp("router-fs"))
    app = {
        "cluster": cluster,
        "services": services,
        "root": root,
        "model": tiny_model,
        "dashboard": f"http://{ctx.dashboard_url}",
    }
    t0 = time.perf_counter()
    _deploy(serve, tiny_model, root, 2)
    _wait_replicas(2)
    print(f"2 replicas ready in {time.perf_counter() - t0:.0f} s")
    yield app
    serve.shutdown()
    services.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _deploy(serve: Any, model: str, root: str, replicas: int) -> None:
    from raykv.serve import build_app

    app = build_app(
        model,
        model_id=MODEL_ID,
        raykv={"namespace": NAMESPACE, "tiers": [{"type": "object_store"}, {"type": "fs", "root": root}]},
        cpu_bytes=8 * (128 << 10),
        engine_kwargs={
            "max_model_len": 4096,
            "num_gpu_blocks_override": 48,
            "enforce_eager": True,
            "enable_prompt_tokens_details": True,
        },
        accelerator="cpu",
        num_replicas=replicas,
        router="raykv",
        # Affinity weighed by the overload cap only, so the test decides who is overloaded.
        router_kwargs={"load_weight": 0.0},
        placement_group_config={"bundles": [{"CPU": 1, "llm_slot": 1}]},
        env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address},
    )
    # The external scaler lets the test change num_replicas of the running app
    # without redeploying it (a redeploy restarts every replica).
    serve.run(app, name="raykv-routed", route_prefix="/", blocking=False, external_scaler_enabled=True)


def _auth_headers() -> dict[str, str]:
    """The cluster's token (what `ray get-auth-token` prints) as a dashboard request's header."""
    cli = [sys.executable, "-m", "ray.scripts.scripts", "get-auth-token"]  # the `ray` console script
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    token = out.stdout.strip() if out.returncode == 0 else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def _scale(app: dict[str, Any], replicas: int) -> None:
    """Set the running deployment's replica count (Serve's external scaling REST API)."""
    url = f"{app['dashboard']}/api/v1/applications/raykv-routed/deployments/LLMServer:{MODEL_ID}/scale"
    r = requests.post(url, json={"target_num_replicas": replicas}, headers=_auth_headers(), timeout=60)
    assert r.status_code == 200, (r.status_code, r.text)


def _alive_actors(**fields: str) -> list[Any]:
    """Ray's state API: the alive actors whose ``fields`` (``name``, ``ray_namespace``...) match."""
    from ray.util.state import list_actors

    filters = [(k, "=", v) for k, v in fields.items()]
    # This cluster's (its GCS finds its dashboard): other Rays may run on this machine.
    address = ray.get_runtime_context().gcs_address
    return list_actors(address, filters=[*filters, ("state", "=", "ALIVE")], limit=10_000)


def _replica_owners() -> dict[str, str]:
    """Alive Serve LLM replicas: actor id (hex) -> actor name (namespace "serve")."""
    return {
        a.actor_id: a.name
        for a in _alive_actors(ray_namespace="serve")
        if a.name.startswith("SERVE_REPLICA::") and "LLMServer" in a.name
    }


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get("raykv-routed")
    deployment = app.deployments.get(f"LLMServer:{MODEL_ID}") if app else None
    return int((deployment.replica_states or {}).get("RUNNING", 0)) if deployment else 0


def _engine_holders(services: Any) -> dict[str | None, HolderInfo]:
    return {h.owner: h for h in services.holders() if h.medium == ENGINE}


def _wait_replicas(n: int, timeout_s: float = 480) -> None:
    """Until the app answers and ``n`` engines have announced their caches."""
    services = raykv.attach(NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ok = requests.get("http://127.0.0.1:8000/v1/models", timeout=5).ok
        except requests.RequestException:
            ok = False
        if ok and len(_engine_holders(services)) >= n and _running_replicas() >= n:
            return
        assert time.monotonic() < deadline, f"the app did not come up with {n} engines"
        time.sleep(1)


def _complete(tokens: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_ID, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 5, **extra}
    r = requests.post(URL, json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


@contextlib.contextmanager
def _long_loads(app: dict[str, Any], prompts: list[list[int]], block: int, replica: str) -> Iterator[None]:
    """Long requests (2000 tokens each, streamed) on ``replica``, each one's prompt held there
    (block ``block``) before the next is sent; they decode until the ``with`` block ends. Then
    the client hangs up, which cancels them in Serve and the engine: nothing waits them out."""
    readers = []  # each stream's line reader: one dropped closes its connection (urllib3)
    with contextlib.ExitStack() as streams:
        for prompt in prompts:
            body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            r = streams.enter_context(requests.post(URL, json=body, stream=True, timeout=600))
            assert r.status_code == 200, r.text
            readers.append(r.iter_lines())
            first = next(line for line in readers[-1] if line)  # its first token: computed
            assert first.startswith(b"data: {"), first
            assert _holders_of_block(app, prompt, block) == {replica}
        yield


def _cached(resp: dict[str, Any]) -> int:
    return int((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _layout(app: dict[str, Any]) -> EngineLayout:
    idents = app["services"].identities()
    (tag, ident), *_ = [(t, i) for t, i in idents.items() if i.model == app["model"]]
    return EngineLayout.from_identity(tag, ident)


def _holders_of_block(app: dict[str, Any], tokens: list[int], block: int, timeout_s: float = 20.0) -> set[str]:
    """The replicas (owner actor ids) whose engine holds block ``block`` of ``tokens``; waits for one."""
    layout = _layout(app)
    engine_keys, _ = request_keys(block_hashes(tokens, layout.tokens_per_hash), layout)
    deadline = time.monotonic() + timeout_s
    while True:
        (holders,) = app["services"].directory.lookup([engine_keys[block]])
        owners = {h.owner for h in holders if h.medium == ENGINE}
        if owners or time.monotonic() > deadline:
            return owners
        time.sleep(0.1)


def _session(s: int, turns: int) -> list[int]:
    """Session ``s``'s prompt after ``turns`` turns (each turn adds blocks to the previous prompt)."""
    tokens = make_prompt_tokens(TURN, 100 + s)
    for t in range(1, turns):
        tokens = tokens + make_prompt_tokens(2 * BLOCK, 1000 * s + t)
    return tokens


def test_follow_up_turns_go_to_the_replica_holding_their_prefix(routed_app) -> None:
    app = routed_app
    _complete(make_prompt_tokens(200, 7))  # kernel set-up
    first: dict[int, str] = {}
    for s in range(4):
        cold = _complete(_session(s, 1))
        assert _cached(cold) == 0
        (first[s],) = _holders_of_block(app, _session(s, 1), 4)
    assert len(set(first.values())) == 2, "two replicas share the sessions"
    app["turn2"] = {}
    for s in range(4):
        prompt = _session(s, 2)
        resp = app["turn2"][s] = _complete(prompt)
        assert _cached(resp) >= TURN, resp["usage"]
        # The turn's new blocks were computed by the replica that held its first turn.
        assert _holders_of_block(app, prompt, 6) == {first[s]}, f"session {s} left its replica"
    app["first"] = first


def _head_node() -> str:
    (head,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    return head


def _actor_node(**fields: str) -> str:
    """The node (hex id) the one alive actor matching ``fields`` runs on."""
    (actor,) = _alive_actors(**fields)
    return actor.node_id


def test_engines_register_their_own_nodes(routed_app) -> None:
    """Each engine process joins Ray through ``RAY_ADDRESS``, which on this one-host
    cluster connects it to the head's raylet; raykv still records it on its replica's
    node, and its blocks go to that node's object store actor."""
    app = routed_app
    services = app["services"]
    engines = _engine_holders(services)
    assert len(engines) == 2
    replica_node = {owner: _actor_node(actor_id=owner) for owner in engines}
    assert len(set(replica_node.values())) == 2, f"the replicas share a node: {replica_node}"
    assert {h.node_id for h in engines.values()} == set(replica_node.values())
    for owner, holder in engines.items():
        assert holder.node_id == replica_node[owner], f"engine of replica {owner} registered another node"
        cache_node = _actor_node(name=holder.actor_name, ray_namespace=NAMESPACE)
        # (soft affinity to the engine's node: where it runs is Ray's call)
        print(
            f"replica {owner[:8]}: node {str(holder.node_id)[:8]}, engine-cache actor on "
            f"{cache_node[:8]}, head {_head_node()[:8]}"
        )
    # The sessions of the first test: each replica's blocks reached its own node's
    # object store actor, never another node's (vLLM's cascade is best effort, so
    # not necessarily every session's).
    layout = _layout(app)
    stored_on: dict[str, set[str]] = {owner: set() for owner in engines}
    for s, owner in app["first"].items():
        _, tier_keys = request_keys(block_hashes(_session(s, 1), layout.tokens_per_hash), layout)
        deadline = time.monotonic() + 10
        while True:
            found = services.directory.lookup(tier_keys)
            nodes = {h.node_id for hs in found for h in hs if h.tier_type == "object_store"}
            if nodes or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert nodes <= {replica_node[owner]}, f"session {s} (replica on {replica_node[owner]}) stored on {nodes}"
        stored_on[owner] |= nodes
    assert stored_on == {owner: {node} for owner, node in replica_node.items()}, stored_on
    # Each node's object store actor mapped the CPU primary of one engine: its own.
    for node in replica_node.values():
        actor = ray.get_actor(naming.object_store_actor(node), namespace=NAMESPACE)
        stats = ray.get(actor.stats.remote(), timeout=30).figures
        assert stats["node_id"] == node and stats["mapped_regions"] == 1, stats
    # raykv status shows the two engines on their nodes.
    rows = [t for t in collect_status(services, metrics=False)["tiers"] if t.get("owner") in engines]
    assert {r.get("node_id") for r in rows} == set(replica_node.values()), rows


def test_a_request_is_routed_away_from_an_overloaded_replica(routed_app) -> None:
    app = routed_app
    busy = app["first"][0]
    # Two long requests sharing session 0's prefix: both go to its replica (affinity).
    loads = [_session(0, 1) + make_prompt_tokens(BLOCK, 5000 + i) for i in range(2)]
    with _long_loads(app, loads, 5, busy):
        # Now it runs two requests and the other replica none: session 0's next turn goes elsewhere.
        prompt = _session(0, 3)
        resp = _complete(prompt)
        owners = _holders_of_block(app, prompt, 8)
    assert owners and busy not in owners, "the overloaded replica took the request"
    assert _cached(resp) >= TURN  # and it still found the prefix, from raykv
    # The client hung up on the two long requests: Serve cancels them, and the router's
    # books (Serve's on_request_completed, called for cancelled requests too) count them
    # no more. So the next request that the busy replica's engine holds the most of
    # (the loads' own block 5) goes there again; two requests still counted would make
    # the replica overloaded and send it away, as above.
    replica = ray.get_actor(_replica_owners()[busy], namespace="serve")
    # Serve's replica actor's own count, what Serve's probes read (Ray 2.60; no public API).
    wait_until(
        lambda: ray.get(replica.get_num_ongoing_requests.remote(), timeout=30) == 0,
        timeout_s=60,
        what="the busy replica to end the cancelled requests",
    )
    time.sleep(2)  # the router hears each end from its replica's stream, within milliseconds
    again = loads[0] + make_prompt_tokens(BLOCK, 6000)
    _complete(again)
    assert _holders_of_block(app, again, 6) == {busy}, "cancelled requests still count on their replica"


def test_a_killed_replica_leaves_the_directory_and_routing(routed_app) -> None:
    app = routed_app
    services = app["services"]
    victim = app["first"][0]
    replicas = _replica_owners()
    assert victim in replicas and victim in _engine_holders(services)
    victim_actor = ray.get_actor(replicas[victim], namespace="serve")
    ray.kill(victim_actor, no_restart=True)
    t0 = time.monotonic()
    while victim in _engine_holders(services):
        assert time.monotonic() - t0 < 5, "the dead engine's cache stayed in the directory"
        time.sleep(0.05)
    print(f"engine holder gone {time.monotonic() - t0:.2f} s after the kill")
    # One replica from now on (the next test raises num_replicas on the running app). Only
    # once Serve's health check has seen the death: scaled down before that, Serve counts
    # the dead replica as running and may stop the live one instead. After it, the
    # replacement Serve starts is not running yet, and a scale-down stops that one first.
    while _running_replicas() != 1:
        assert time.monotonic() - t0 < 120, "Serve did not notice the dead replica"
        time.sleep(0.2)
    _scale(app, 1)
    # Its sessions keep being served (by the other replica, from raykv), never by the dead one.
    for s in (0, 2):
        prompt = _session(s, 4)
        resp = _complete(prompt)
        assert resp["choices"][0]["text"] is not None
        assert victim not in _holders_of_block(app, prompt, 10)


def test_an_added_replica_gets_its_first_prefix_from_raykv(routed_app) -> None:
    """num_replicas raised on the running app: the old replica keeps serving, and the new
    one's first request finds its prefix in raykv."""
    app = routed_app
    services = app["services"]
    (old,) = set(app["first"].values()) - {app["first"][0]}
    deadline = time.monotonic() + 120  # a replacement stopped while starting leaves
    while set(_engine_holders(services)) != {old} or _running_replicas() != 1:
        assert time.monotonic() < deadline, (
            f"not one replica after the kill: engines {sorted(_engine_holders(services))} (old {old}), "
            f"{_running_replicas()} running"
        )
        time.sleep(0.5)
    before_replicas = set(_replica_owners())
    _scale(app, 2)
    _wait_replicas(2)
    assert old in _replica_owners(), "raising num_replicas restarted the running replica"
    time.sleep(2)  # the ingress's router hears of the new replica
    (new,) = set(_engine_holders(services)) - {old}
    assert new not in before_replicas
    # Two long requests on the old replica (the last prompt it computed, so affinity
    # sends them there) leave it overloaded: the next request goes to the new one.
    base = _session(2, 4)
    loads = [base + make_prompt_tokens(BLOCK, 7000 + i) for i in range(2)]
    with _long_loads(app, loads, len(base) // BLOCK, old):
        prompt = _session(1, 2)  # computed (and answered) in the first test: in raykv's tiers
        warm = _complete(prompt)
        deadline = time.monotonic() + 20
        while new not in _holders_of_block(app, prompt, 6):  # the old one may hold it from before
            assert time.monotonic() < deadline, "the new replica did not take the request"
            time.sleep(0.1)
    assert _cached(warm) >= TURN, warm["usage"]  # its first request's prefix came from raykv
    before = app["turn2"][1]
    assert warm["choices"][0]["text"] == before["choices"][0]["text"]
    # Not bit-equal: the two split the prompt between cached and computed tokens at
    # different places (640 + 256 against 895 + 1), so float sums differ by ~1e-6.
    for got, want in zip(
        warm["choices"][0]["logprobs"]["top_logprobs"], before["choices"][0]["logprobs"]["top_logprobs"]
    ):
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, abs=1e-4)  # vLLM's CPU backend
    # raykv status shows the new engine's hits by source.
    deadline = time.monotonic() + 10
    while True:
        (row,) = [t for t in collect_status(services, metrics=False)["tiers"] if t.get("owner") == new]
        loaded = (row.get("stats") or {}).get("loaded_by_tier") or {}
        if sum(loaded.values()) >= TURN // BLOCK or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(loaded.values()) >= TURN // BLOCK, row
    # And the same as a recompute: a cache_salt of its own names other blocks, so
    # nothing is cached for it anywhere.
    fresh = _complete(prompt, cache_salt="raykv-router-test-recompute")
    assert _cached(fresh) == 0, fresh["usage"]
    assert warm["choices"][0]["text"] == fresh["choices"][0]["text"]
    for got, want in zip(
        warm["choices"][0]["logprobs"]["top_logprobs"], fresh["choices"][0]["logprobs"]["top_logprobs"]
    ):
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, abs=1e-4)  # vLLM's CPU backend
