"""raykv.serve.routing: a prompt's keys as vLLM names them, what each replica would find, ranking."""

from __future__ import annotations

import asyncio

import numpy as np
from ray.serve.request_router import PendingRequest

from raykv.core.contract import ReqContext
from raykv.core.keys import make_offload_key
from raykv.core.placement import ENGINE, PLASMA, SHARED, HolderInfo
from raykv.core.tenants import TenantSharing
from raykv.core.wire import PENDING
from raykv.holders.engine_cache import ENGINE_GROUP, engine_key
from raykv.serve.prompts import RoutedPrompt, prompt_of
from raykv.serve.routing import (
    Candidate,
    EngineLayout,
    Match,
    RankPolicy,
    affinity,
    computing,
    credit_soon_held,
    match,
    rank,
    request_keys,
)
from tiers.example.tier import ExampleTier

TAG = bytes(range(8))


def _engine(owner: str, node: str) -> HolderInfo:
    return HolderInfo(f"engine:{node}:{owner}", "engine", ENGINE, f"raykv-engine-{owner}", "ns", node, owner)


PLASMA_A = HolderInfo("object_store:a", "object_store", PLASMA, "os-a", "ns", "a")
SHARED_FS = HolderInfo("fs:r", "fs", SHARED, "fs-r", "ns", None)
A, B, C = Candidate("ra", "oa", "a"), Candidate("rb", "ob", "b"), Candidate("rc", "oc", "b")


def test_engine_keys_are_their_own_family_and_match_vllm_int_hashes() -> None:
    h = bytes(range(32))
    key = engine_key(TAG, h)
    assert key.startswith(TAG) and key.endswith(ENGINE_GROUP) and len(key) == 8 + 8 + 4
    # vLLM's KV events carry the low 64 bits of the hash as an int by default
    assert engine_key(TAG, int.from_bytes(h, "big") & (2**64 - 1)) == key
    engine, tier = request_keys([h, h[::-1], h], EngineLayout(TAG, 128, blocks_per_chunk=2))
    assert engine == [engine_key(TAG, x) for x in (h, h[::-1], h)]
    assert tier == [TAG + h[::-1] + b"\0\0\0\0"]  # one full chunk of 2 blocks: its last block's hash
    assert not set(engine) & set(tier)


def _routed(**body: object) -> RoutedPrompt:
    """What the router reads of a request with this body (Serve builds requests on its event loop)."""

    async def read() -> RoutedPrompt:
        return prompt_of(PendingRequest(args=[body], kwargs={}, metadata=None))

    return asyncio.run(read())


def test_a_labelled_tenants_tier_keys_are_the_ones_its_tiers_store() -> None:
    h = bytes(range(32))
    sharing = TenantSharing({"team": ["a", "b"]})
    routed = _routed(prompt=[1, 2], kv_transfer_params={"tenant": "a"})
    assert routed == RoutedPrompt([1, 2], None, "a")
    scope = sharing.scope_of_tenant(routed.tenant)
    _, tier = request_keys([h], EngineLayout(TAG, 128, blocks_per_chunk=1), scope)
    stored = ExampleTier(memoryview(np.zeros((1, 4096), np.uint8)), "example", ExampleTier.Options())
    stored.key_tag, stored.tenant_sharing = TAG, sharing
    ctx = ReqContext("r", kv_transfer_params={"tenant": "b"})  # b shares a's group
    assert tier == [stored.scope(make_offload_key(h, 0), ctx)] != request_keys([h], EngineLayout(TAG, 128, 1))[1]
    assert _routed(prompt="x", cache_salt="s") == ("x", "s", None)


def test_match_counts_leading_engine_blocks_then_raykv_blocks_per_node() -> None:
    ea, eb = _engine("oa", "a"), _engine("ob", "b")
    engine_found = [[ea, eb], [ea], [ea], [], []]
    tier_found = [[PLASMA_A], [PLASMA_A], [PLASMA_A], [PLASMA_A], []]
    got = match(engine_found, tier_found, 1, [A, B, C])
    assert (got["ra"].engine, got["ra"].raykv_local, got["ra"].raykv_remote) == (3, 1, 0)
    assert (got["rb"].engine, got["rb"].raykv_local, got["rb"].raykv_remote) == (1, 0, 3)  # a's plasma: remote
    assert (got["rc"].engine, got["rc"].raykv) == (0, 4)
    assert got["rc"].recompute == 1 and got["ra"].recompute == 1
    # shared storage is local for every node; a hole ends the prefix
    got = match([[], []], [[SHARED_FS], []], 1, [B])
    assert (got["rb"].raykv_local, got["rb"].recompute) == (1, 1)


def test_an_engine_holder_without_owner_matches_the_only_replica_on_its_node() -> None:
    anon = HolderInfo("engine:a:1", "engine", ENGINE, "e", "ns", "a", None)
    assert match([[anon]], [[]], 1, [A, B])["ra"].engine == 1
    anon_b = HolderInfo("engine:b:1", "engine", ENGINE, "e", "ns", "b", None)
    got = match([[anon_b]], [[]], 1, [A, B, C])  # two replicas on node b: nobody gets it
    assert got["rb"].engine == got["rc"].engine == 0


def test_rank_prefers_the_engine_hit_then_balances_load() -> None:
    matches = {"ra": Match(engine=8, total=8), "rb": Match(raykv_local=8, total=8), "rc": Match(total=8)}
    assert rank(matches, {"ra": 0, "rb": 0, "rc": 0})[0] == ["ra"]
    # a queue costs load_weight x blocks per request: one request ahead of "ra" ties it with "rb"
    policy = RankPolicy(load_weight=0.5)
    assert rank(matches, {"ra": 1, "rb": 0, "rc": 0}, policy)[0] == ["rb"]
    # without a load weight only the overload cap moves it: 2 ahead of the least loaded, > 1.5x the mean
    policy = RankPolicy(load_weight=0.0)
    assert rank(matches, {"ra": 1, "rb": 0, "rc": 0}, policy)[0] == ["ra"]
    ranks = rank(matches, {"ra": 2, "rb": 0, "rc": 0}, policy)
    assert ranks[0] == ["rb"] and ranks[-1] == ["ra"]


def test_an_engine_hit_shares_no_rank_with_a_load_that_costs_nearly_as_much() -> None:
    """A new session's first turn, whose system prompt (3 of 5 blocks) one engine holds with
    a request queued, and raykv holds for an idle replica. The engine holder costs 0.2 blocks
    less; had they shared a rank, Serve would have sent the request to the idle replica (the
    least loaded of a rank), and the engine hit would have been lost."""
    matches = {"ra": Match(engine=3, total=5), "rb": Match(raykv_local=3, total=5), "rc": Match(raykv_local=3, total=5)}
    ranks = rank(matches, {"ra": 1, "rb": 1, "rc": 0}, RankPolicy(load_weight=0.2))
    assert ranks[0] == ["ra"]
    assert ranks[1:] == [["rc"], ["rb"]]
    # replicas that would find the same blocks share no rank either: Serve would pick one by its
    # own queue cache, not the one this decision counts on; a queue longer by one goes after
    same = {"ra": Match(engine=3, total=5), "rb": Match(engine=3, total=5), "rc": Match(total=5)}
    ranks = rank(same, {"ra": 0, "rb": 0, "rc": 0}, RankPolicy(load_weight=0.05))
    assert sorted(ranks[0] + ranks[1]) == ["ra", "rb"] and ranks[2] == ["rc"]
    assert rank(same, {"ra": 1, "rb": 0, "rc": 0}, RankPolicy(load_weight=0.05))[:2] == [["rb"], ["ra"]]


def test_every_rank_holds_one_replica() -> None:
    """Serve takes the least loaded of a rank by its own queue-length cache, which lacks the
    requests this router decided and Serve has not sent yet: a rank of several would let it
    send elsewhere than where the decision counted the request (and its prefix)."""
    idle = {r: Match(total=4) for r in ("ra", "rb", "rc")}
    ranks = rank(idle, {"ra": 0, "rb": 0, "rc": 0})
    assert all(len(one) == 1 for one in ranks) and sorted(r for (r,) in ranks) == ["ra", "rb", "rc"]
    # within an exact tie of cost and queue: the least new work sent first, then the affinity
    ranks = rank(idle, {}, spread={"ra": 8.0, "rb": 0.0, "rc": 4.0})
    assert ranks == [["rb"], ["rc"], ["ra"]]
    ranks = rank(idle, {}, ties={"ra": 0.9, "rb": 0.5, "rc": 0.1})
    assert ranks == [["rc"], ["rb"], ["ra"]]


def test_rank_spreads_fresh_prompts_by_the_work_already_sent() -> None:
    matches = {"ra": Match(total=4), "rb": Match(total=4)}
    assert rank(matches, {"ra": 0, "rb": 0}, spread={"ra": 4.0, "rb": 0.0}) == [["rb"], ["ra"]]
    assert rank(matches, {"ra": 0, "rb": 0}, spread={"ra": 0.0, "rb": 4.0}) == [["ra"], ["rb"]]


def _pending(owner: str, node: str) -> HolderInfo:
    return HolderInfo(f"pending:{node}:{owner}", "pending", PENDING, f"raykv-pending-{owner}", "ns", node, owner)


def test_blocks_a_replica_computes_now_count_as_its_own_soon() -> None:
    """Compute once (issue 25): the replica computing a prompt's new blocks (its pending
    entries) is credited them as its engine cache's; the others as loads of its copy."""
    # chunk 0 held by a's plasma, chunks 1-2 pending on rb (node b), chunk 3 nobody's
    tier_found = [[PLASMA_A], [], [], []]
    pending_found = [[], [_pending("ob", "b")], [_pending("ob", "b")], []]
    soon = computing(pending_found, tier_found, 2, 8, [A, B, C])
    assert soon == {"rb": 6}
    # a hole before the pending chunks: nothing is soon held through it
    assert computing([[], [_pending("ob", "b")]], [[], []], 2, 4, [A, B]) == {}
    matches = match([[]] * 8, tier_found, 2, [A, B, C])
    assert (matches["rb"].engine, matches["rb"].raykv_remote) == (0, 2)
    credit_soon_held(matches, soon)
    assert (matches["rb"].engine, matches["rb"].raykv, matches["rb"].recompute) == (6, 0, 2)
    # ra finds chunk 0 in its node's plasma, and waits for rb's copy of the next two
    assert (matches["ra"].engine, matches["ra"].raykv_local, matches["ra"].raykv_remote) == (0, 2, 4)
    assert matches["rc"].raykv == 6
    ranks = rank(matches, {"ra": 0, "rb": 0, "rc": 0})
    assert ranks[0] == ["rb"]
    # while rb's queue is long, the others come first (they wait for its copy)
    assert rank(matches, {"ra": 0, "rb": 3, "rc": 0})[0] != ["rb"]


def test_replicas_that_tie_on_a_new_prefix_are_ordered_by_its_first_block() -> None:
    """Every router orders tied replicas the same way for one prompt (rendezvous
    hashing), and different prompts spread over the replicas."""
    ids = {"ra": "oa", "rb": "ob", "rc": "oc"}
    matches = {r: Match(total=4) for r in ids}
    firsts = set()
    for i in range(30):
        key = bytes([i]) * 16
        order = rank(matches, {}, ties=affinity(key, ids))
        assert order == rank(matches, {}, ties=affinity(key, dict(ids)))  # the same every time
        order = [r for (r,) in order]
        firsts.add(order[0])
    assert firsts == set(ids)


def test_a_prefix_pinned_in_one_nodes_plasma_goes_to_that_nodes_replica_unless_it_is_overloaded() -> None:
    """Prompt caching (issue 27): a pinned prefix is an ordinary held block to the router,
    so the replica on the node whose object store holds it finds it without a pull."""
    blocks = 160  # a 20k-token prefix of 128-token blocks, pinned in node a's plasma only
    got = match([[]] * blocks, [[PLASMA_A]] * blocks, 1, [A, B])
    assert (got["ra"].raykv_local, got["rb"].raykv_remote) == (blocks, blocks)
    assert rank(got, {"ra": 0, "rb": 0})[0] == ["ra"]
    # its queue counts against it: past the overload cap, the other node pulls the prefix instead
    policy = RankPolicy(load_weight=0.0)
    assert rank(got, {"ra": 1, "rb": 0}, policy)[0] == ["ra"]
    assert rank(got, {"ra": 3, "rb": 0}, policy)[0] == ["rb"]
    # a copy in every node's plasma (raykv warm --all-nodes): both find it locally, load decides
    plasma_b = HolderInfo("object_store:b", "object_store", PLASMA, "os-b", "ns", "b")
    both = match([[]] * blocks, [[PLASMA_A, plasma_b]] * blocks, 1, [A, B])
    assert both["ra"].raykv_local == both["rb"].raykv_local == blocks
    assert rank(both, {"ra": 1, "rb": 0})[0] == ["rb"]
