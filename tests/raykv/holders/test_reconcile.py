"""Tier actors repair drift between their holdings and the directory.

A shard can lose a live holder's entries without the holder dying (a watch
that errors under load, a rebuild that could not reach it, a call lost while
the shard restarted); the holder's periodic reconcile puts them back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

import raykv
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import OffloadKey, prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from raykv.services.cluster import RaykvServices
from tests.waiting import wait_until

NS = "raykv-reconcile"


def _listed(services, keys) -> int:
    return sum(1 for hs in services.directory.lookup(scoped_keys(keys)) if hs)


@contextmanager
def _stored(namespace: str, blocks: int) -> Iterator[tuple[RaykvServices, Any, list[OffloadKey]]]:
    """raykv started in ``namespace`` (reconcile every 0.5 s) and an object store tier that
    stored ``blocks`` blocks: (services, tier, keys). Shuts down what runs in the namespace then."""
    services = raykv.start({"namespace": namespace, "directory_shards": 2, "holder_reconcile_s": 0.5})
    with PrimaryRegion(blocks, 4096) as region:
        tier = TierFactory.create_tier({"type": "object_store", "namespace": namespace}, region.view, services=services)
        try:
            keys = prefix_keys(list(range(16 * blocks)), 16)
            assert TierDriver(tier).store(keys, list(range(blocks))).success
            yield services, tier, keys
        finally:
            tier.shutdown()
    raykv.attach(namespace).shutdown()  # (a test may have started the services again)


def test_a_holder_dropped_at_a_shard_while_alive_is_relisted(ray_local) -> None:
    with _stored(NS, 24) as (services, tier, keys):
        assert _listed(services, keys) == 24
        holder = tier.holder_id
        # drift: shard 0 forgets the (live) holder, shard 1 loses some entries
        ray.get(services.directory.shards[0].remove_holder.remote(holder, "spurious"))
        shard1 = [k for k in scoped_keys(keys) if raykv.core.keys.shard_of(k, 2) == 1][:3]
        ray.get(services.directory.shards[1].unregister.remote(holder, shard1))
        assert _listed(services, keys) < 24
        wait_until(lambda: _listed(services, keys) == 24, timeout_s=20, what="the holder to repair the directory")
        # each shard lists exactly the holder's keys again
        counts = ray.get([s.holder_counts.remote(holder) for s in services.directory.shards])
        assert sum(counts) == 24


def test_holders_repair_and_announce_after_the_control_actor_is_killed_for_good(ray_local) -> None:
    """``ray.kill`` (no restart) of the control actor: tier actors still repair the directory,
    and once ``raykv start`` started another control actor they announce themselves to it."""
    ns = f"{NS}-control"
    with _stored(ns, 8) as (services, tier, keys):
        ray.kill(services.control)  # Ray's default: no restart
        ray.get(services.directory.shards[0].remove_holder.remote(tier.holder_id, "spurious"))
        assert _listed(services, keys) < 8
        wait_until(lambda: _listed(services, keys) == 8, timeout_s=20, what="the repair without a control actor")

        control = raykv.start({"namespace": ns, "directory_shards": 2, "holder_reconcile_s": 0.5}).control
        assert control != services.control
        wait_until(
            lambda: tier.holder_id in {h.holder_id for h in ray.get(control.holders.remote())},
            timeout_s=20,
            what="the holder announced to the new control actor",
        )
