"""A directory shard killed for good (``ray.kill``'s default, ``no_restart=True``):
the control actor starts it again, and holders, agents and engine-side
clients that kept the dead actor's handle move to the new one, on a real local Ray."""

from __future__ import annotations

import time

import pytest
import ray

import raykv
from raykv.core.contract import LookupResult
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import prefix_keys, shard_of
from raykv.directory.client import DirectoryClient
from raykv.directory.replaced import HEAL_EVERY_S, live_shard
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.waiting import wait_until

BLOCKS = 8


def _keys(salt: str) -> list[bytes]:
    keys = prefix_keys(list(range(16 * BLOCKS)), 16, salt=salt)
    # Both shards own some of them, or the test would not reach the replaced one.
    assert {shard_of(k, 2) for k in scoped_keys(keys)} == {0, 1}, salt
    return keys


def _successor(namespace: str, old: ray.actor.ActorHandle) -> ray.actor.ActorHandle | None:
    new = live_shard(namespace, 1)
    return new if new is not None and new != old and ray.get(new.ping.remote(), timeout=10) else None


def _all_listed(services: raykv.RaykvServices, keys: list[bytes]) -> bool:
    """Whether this process's engine-side directory client (``LookupCache.client``) lists
    a holder for every key: a call of its own, not the tier's memory of its stores."""
    return all(services.lookup_cache.client.lookup_async(scoped_keys(keys)).result(timeout=5.0))


def _wait_until_found(shards: DirectoryClient, services: raykv.RaykvServices, keys: list[bytes], case: str) -> None:
    """Every key listed by the shards now running (lost registrations repaired), then found by
    this process's engine-side client (the node agent's, or the shards'), which kept the dead
    actor's handle: the tier's own lookups would answer from what it stored itself."""
    wait_until(
        lambda: all(shards.lookup(scoped_keys(keys))),
        timeout_s=30.0,
        interval_s=0.2,
        what=f"every key, stored before the kill and after it, listed by the shards now running ({case})",
    )
    wait_until(
        lambda: _all_listed(services, keys),
        timeout_s=30.0,
        interval_s=0.2,
        ignore=(ray.exceptions.RayActorError,),
        what=f"the client that kept the dead actor's handle to find every key ({case})",
    )


@pytest.mark.parametrize("agent", [True, False], ids=["through the agent", "straight to the shards"])
def test_a_shard_killed_for_good_is_started_again_and_every_caller_finds_it(ray_local, agent) -> None:
    namespace = f"raykv-replaced-{'agent' if agent else 'direct'}"
    services = raykv.start(
        {"namespace": namespace, "directory_shards": 2, "holder_reconcile_s": 0.5, "directory_agent": agent}
    )
    try:
        with PrimaryRegion(2 * BLOCKS, 4096) as region:
            tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
            before, after = _keys("stored before the kill"), _keys("stored after it")
            assert TierDriver(tier).store(before, list(range(BLOCKS))).success

            old = live_shard(namespace, 1)
            assert old is not None
            ray.kill(old, no_restart=True)
            wait_until(
                lambda: _successor(namespace, old),
                timeout_s=30.0,
                interval_s=0.2,
                ignore=(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError),
                what="the control actor to start shard 1 again",
            )
            # The tier actor, its agent (if any) and this process's client still hold the dead handle.
            assert TierDriver(tier).store(after, list(range(BLOCKS, 2 * BLOCKS))).success

            shards = [live_shard(namespace, i) for i in range(2)]
            fresh = DirectoryClient([s for s in shards if s is not None])
            _wait_until_found(fresh, services, before + after, "a shard replaced")
    finally:
        services.shutdown()
    assert live_shard(namespace, 1) is None, "stop leaves no shard behind (the control actor goes first)"


def test_a_node_agent_killed_for_good_is_started_again_and_its_callers_follow(ray_local) -> None:
    """The tier actor's registrations and this process's lookups went through the dead
    agent: their next failure has it started again, and the registrations lost meanwhile
    come back with the tier actor's reconcile round."""
    namespace = "raykv-replaced-node-agent"
    services = raykv.start({"namespace": namespace, "directory_shards": 2, "holder_reconcile_s": 0.5})
    try:
        with PrimaryRegion(2 * BLOCKS, 4096) as region:
            tier = TierFactory.create_tier({"type": "object_store"}, region.view, services=services)
            before, after = _keys("stored before the kill"), _keys("stored after it")
            assert TierDriver(tier).store(before, list(range(BLOCKS))).success
            assert tier.lookup_blocking(before) == [LookupResult.HIT] * BLOCKS

            agents = services.directory_agents()
            assert len(agents) == 1
            old = next(iter(agents.values()))
            ray.kill(old, no_restart=True)
            wait_until(
                lambda: old not in services.directory_agents().values(),
                timeout_s=30.0,
                interval_s=0.1,
                what="the killed agent's name to be free",
            )
            assert TierDriver(tier).store(after, list(range(BLOCKS, 2 * BLOCKS))).success

            _wait_until_found(services.directory, services, before + after, "a node agent replaced")
            assert tier.lookup_blocking(before + after) == [LookupResult.HIT] * (2 * BLOCKS)
            new = services.directory_agents()
            assert len(new) == 1 and old not in new.values()
    finally:
        services.shutdown()
    # After `raykv stop` a failed call through the agent must not start one behind it.
    time.sleep(HEAL_EVERY_S)  # past the wait after the heal above: the next failure may act (under test)
    with pytest.raises(ray.exceptions.RayActorError):
        _all_listed(services, before)
    time.sleep(2 * HEAL_EVERY_S)  # the time a heal thread would take to start an agent: under test
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
