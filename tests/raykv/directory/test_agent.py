"""Node directory agents on a real two-node Ray cluster: views fed by the shards'
change feeds, lookups without a Ray call, merged calls, lag, restarts."""

from __future__ import annotations

import time

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.keys import prefix_keys
from raykv.core.placement import PLASMA, HolderInfo
from raykv.directory.messages import AgentStats
from raykv.holders.holder_actor import WatchableActor
from tests.waiting import wait_until

NS = "raykv-agent-test"
#: A namespace whose views keep only their node's and asked keys (``agent_view_all_keys: false``).
NS_ASKED = "raykv-agent-asked-keys"
MIB = 1 << 20
#: The lag a test waits for at most (the bench's target is 100 ms p99; this host is shared).
LAG_BOUND_S = 1.0


@pytest.fixture(scope="module")
def cluster(make_ray_cluster):
    c, _ = make_ray_cluster(
        head={"num_cpus": 2, "resources": {"node_a": 1}, "object_store_memory": 100 * MIB},
        workers=[{"num_cpus": 2, "resources": {"node_b": 1}, "object_store_memory": 100 * MIB}],
    )
    services = raykv.start({"namespace": NS, "directory_shards": 2, "agent_window_ms": 2.0})
    yield services
    services.shutdown()


@pytest.fixture(scope="module")
def asked(cluster):
    """Services whose views keep only local and asked keys, on the same cluster."""
    services = raykv.start(
        {"namespace": NS_ASKED, "directory_shards": 2, "agent_window_ms": 2.0, "agent_view_all_keys": False}
    )
    yield services
    services.shutdown()


@ray.remote(num_cpus=0)
class FakeHolder(WatchableActor):
    """A holder actor with nothing in it but the watch method."""


@ray.remote(num_cpus=0)
class Engine:
    """An engine process's directory side: its ``LookupCache`` (view + agent)."""

    def __init__(self, namespace: str = NS) -> None:
        self.cache = raykv.attach(namespace).lookup_cache

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def resolve(self, keys: list[bytes], wait_s: float = 5.0) -> tuple[bool, int]:
        """Look ``keys`` up at once; (answered in time, calls sent so far)."""
        return self.cache.resolve(keys, wait_s), self.cache.lookups_sent

    def holders(self, keys: list[bytes]) -> list[list[str] | None]:
        """Each key's holder ids from this process's view or answers (None: unknown)."""
        out = []
        for k in keys:
            hs = self.cache.get(k)
            out.append(None if hs is None else [h.holder_id for h in hs])
        return out

    def forget(self, keys: list[bytes]) -> None:
        """Drop this process's own answers for ``keys`` (as their TTL would)."""
        self.cache.invalidate(keys)

    def view_only(self, keys: list[bytes]) -> list[list[str] | None]:
        """What the node's shared view alone says of ``keys``."""
        assert self.cache.view is not None
        return [None if hs is None else [h.holder_id for h in hs] for hs in self.cache.view.lookup(keys)]

    def first_seen(self, keys: list[bytes], holder_id: str, timeout_s: float) -> float | None:
        """Poll the view until every key names ``holder_id``: when (time.time()), or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.view_only(keys)
            if all(hs is not None and holder_id in hs for hs in found):
                return time.time()
            time.sleep(0.0005)
        return None

    def time_lookup(self, keys: list[bytes], rounds: int = 200) -> list[float]:
        """Seconds per view read of ``keys`` (what an engine's prefix lookup costs)."""
        assert self.cache.view is not None
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.cache.view.lookup(keys)
            out.append(time.perf_counter() - t0)
        return out


def _engine(where: str, namespace: str = NS) -> ray.actor.ActorHandle:
    e = Engine.options(resources={where: 0.01}).remote(namespace)
    ray.get(e.node_id.remote(), timeout=60)
    return e


def _holder(services, name: str, node_id: str) -> HolderInfo:
    ns = services.namespace
    actor = FakeHolder.options(name=name, namespace=ns, resources={"node_a": 0.01}).remote()
    info = HolderInfo(name, "object_store", PLASMA, name, ns, node_id)
    ray.get(services.directory.add_holder(info, actor))
    return info


def _keys(n: int, seed: int) -> list[bytes]:
    return prefix_keys(list(range(seed * 100_000, seed * 100_000 + n * 16)), 16)


def _agent_stats(services, node_id: str) -> AgentStats:
    agent = ray.get_actor(naming.directory_agent(node_id), namespace=services.namespace)
    return ray.get(agent.stats.remote(), timeout=30)


def test_a_block_stored_on_a_is_seen_on_b_within_the_lag_bound(cluster):
    services = cluster
    eng_a, eng_b = _engine("node_a"), _engine("node_b")
    node_a, node_b = ray.get([eng_a.node_id.remote(), eng_b.node_id.remote()])
    assert node_a != node_b
    holder = _holder(services, "holder-on-a", node_a)
    keys = _keys(32, seed=1)
    answered, _ = ray.get(eng_b.resolve.remote(keys))
    assert answered and ray.get(eng_b.holders.remote(keys)) == [[]] * 32  # asked: nobody, and B's view knows it
    wait_until(
        lambda: ray.get(eng_b.view_only.remote(keys)) == [[]] * 32,
        timeout_s=10,
        what="B's view to know the keys it asked for (held by nobody)",
    )
    lags = []
    for i in range(5):
        batch = keys[i * 6 : i * 6 + 6]
        seen = eng_b.first_seen.remote(batch, holder.holder_id, 10.0)
        time.sleep(0.05)  # not a wait: B is polling its view when the registration lands
        t0 = time.time()
        ray.get(services.directory.register(holder.holder_id, batch))
        at = ray.get(seen)
        assert at is not None, "node B's view never showed the registration"
        lags.append(at - t0)
    print(f"\nregistration at a shard -> visible in node B's view: {[round(x * 1000, 1) for x in lags]} ms")
    assert max(lags) <= LAG_BOUND_S
    stats = _agent_stats(services, node_b)
    assert stats.lag_p99_s is not None and stats.feed_entries > 0


def test_keys_the_view_knows_need_no_call(asked):
    """A view of asked keys: an unknown prefix costs one call to the agent, and the
    same prefix asked again is answered from the shared view without one."""
    services = asked
    eng = _engine("node_b", NS_ASKED)
    node_a = ray.get(_engine("node_a", NS_ASKED).node_id.remote())
    holder = _holder(services, "holder-view", node_a)
    keys = _keys(32, seed=2)
    ray.get(services.directory.register(holder.holder_id, keys[:16]))
    _, sent = ray.get(eng.resolve.remote(keys))
    assert sent == 1  # unknown: one call, to the agent
    _, sent_again = ray.get(eng.resolve.remote(keys))
    assert sent_again == sent  # answered from the shared view: no call at all
    assert ray.get(eng.holders.remote(keys)) == [["holder-view"]] * 16 + [[]] * 16
    times = sorted(ray.get(eng.time_lookup.remote(keys)))
    p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
    print(f"\n32-key prefix from the view: p50 {p50 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us")


def test_engines_of_a_node_share_calls_to_the_shards(asked):
    """Eight engines on one node ask at the same moment (views of asked keys: every
    new prefix is a question): the agent makes one call per shard for them, not one
    per engine per shard."""
    services = asked
    engines = [_engine("node_a", NS_ASKED) for _ in range(8)]
    node_a = ray.get(engines[0].node_id.remote())
    before = _agent_stats(services, node_a)
    keys = _keys(64, seed=3)
    ray.get([e.resolve.remote(keys[i * 8 : i * 8 + 8] + keys[:8]) for i, e in enumerate(engines)])
    after = _agent_stats(services, node_a)
    engine_calls = after.lookups - before.lookups
    shard_calls = after.shard_calls.get("apply", 0) - before.shard_calls.get("apply", 0)
    print(f"\n8 engines: {engine_calls} engine calls -> {shard_calls} shard calls")
    assert engine_calls == 8
    assert shard_calls < engine_calls * 2  # without the agent: 8 engines x 2 shards


def test_an_agent_killed_is_restarted_and_rebuilds_its_view(cluster):
    services = cluster
    eng = _engine("node_b")
    node_a, node_b = ray.get([_engine("node_a").node_id.remote(), eng.node_id.remote()])
    holder = _holder(services, "holder-restart", node_a)
    keys = _keys(16, seed=4)
    ray.get(services.directory.register(holder.holder_id, keys))
    ray.get(eng.resolve.remote(keys))
    before = _agent_stats(services, node_b)
    agent = ray.get_actor(naming.directory_agent(node_b), namespace=NS)
    ray.kill(agent, no_restart=False)

    def restarted() -> AgentStats | None:
        s = ray.get(agent.stats.remote(), timeout=30)
        return s if s.started_at > before.started_at else None

    wait_until(
        restarted,
        timeout_s=60,
        interval_s=0.05,
        ignore=(ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError),
        what="the agent to restart",
    )
    # the new life starts from the feeds: asked again, the keys are answered (and then known)
    ray.get(eng.forget.remote(keys))
    answered, _ = ray.get(eng.resolve.remote(keys))
    assert answered
    assert ray.get(eng.holders.remote(keys)) == [["holder-restart"]] * 16
    wait_until(
        lambda: ray.get(eng.view_only.remote(keys)) == [["holder-restart"]] * 16,
        timeout_s=10,
        what="the restarted agent's view to know the keys",
    )


def test_a_node_view_holds_its_own_holders_keys_unasked(cluster):
    services = cluster
    eng = _engine("node_a")
    node_a = ray.get(eng.node_id.remote())
    local = _holder(services, "holder-local", node_a)
    keys = _keys(24, seed=5)
    ray.get(services.directory.register(local.holder_id, keys))
    wait_until(
        lambda: ray.get(eng.view_only.remote(keys)) == [["holder-local"]] * 24,
        timeout_s=10,
        what="node A's view to list its own holder's keys without being asked",
    )
    ray.get(services.directory.unregister(local.holder_id, keys[:4]))
    wait_until(
        lambda: ray.get(eng.view_only.remote(keys[:4])) == [[]] * 4,
        timeout_s=10,
        what="the eviction to reach the view",
    )


def test_identity_and_tenant_scoping_hold_through_the_view(cluster):
    """Blocks of one model identity and tenant, held on node A: an engine on node B
    reading its view finds them only under that identity and tenant, never under
    another model's identity or another tenant's salt (the same tokens)."""
    from raykv.core.identity import KVIdentity, scoped_keys

    services = cluster
    eng = _engine("node_b")
    node_a = ray.get(_engine("node_a").node_id.remote())
    holder = _holder(services, "holder-scoped", node_a)
    tokens = list(range(700_000, 700_000 + 8 * 16))
    model_a, model_b = KVIdentity(model="model-a"), KVIdentity(model="model-b")
    stored = scoped_keys(prefix_keys(tokens, 16, salt="tenant-a"), model_a)
    other_model = scoped_keys(prefix_keys(tokens, 16, salt="tenant-a"), model_b)
    other_tenant = scoped_keys(prefix_keys(tokens, 16, salt="tenant-b"), model_a)
    ray.get(services.directory.register(holder.holder_id, stored))
    asked = stored + other_model + other_tenant
    ray.get(eng.resolve.remote(asked))
    want = [["holder-scoped"]] * 8 + [[]] * 16
    wait_until(
        lambda: ray.get(eng.view_only.remote(asked)) == want,
        timeout_s=10,
        what="B's view to hold model A / tenant A's blocks, and nothing under the other identity or tenant",
    )
    assert ray.get(eng.holders.remote(asked)) == want


def test_a_view_of_every_key_answers_without_asking(cluster):
    """The default (``agent_view_all_keys``): node B's view takes node A's keys unasked,
    and once it holds every key, a key it does not list is held by nobody: no call at all."""
    services = cluster
    eng = _engine("node_b")
    node_a = ray.get(_engine("node_a").node_id.remote())
    info = _holder(services, "holder-all", node_a)
    held, never = _keys(16, seed=6), _keys(16, seed=7)
    ray.get(services.directory.register(info.holder_id, held))
    wait_until(
        lambda: ray.get(eng.view_only.remote(held + never)) == [["holder-all"]] * 16 + [[]] * 16,
        timeout_s=10,
        what="B's view to hold A's keys unasked, and to be complete",
    )
    answered, sent = ray.get(eng.resolve.remote(held + never))
    assert answered and sent == 0  # every answer from the view: not one call
    assert _agent_stats(services, ray.get(eng.node_id.remote())).view_scope == "all"
    assert ray.get(eng.holders.remote(held + never)) == [["holder-all"]] * 16 + [[]] * 16
