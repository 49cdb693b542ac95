"""After ``raykv stop`` and ``raykv start``, an engine's tier is built again from its config
and swapped in (``raykv.engine.reattach``); the old tier's jobs each still end in one
result. Real local Ray, real object store tier; the vLLM path is in
``tests/integrations/vllm/test_raykv_tiers.py``."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import raykv
from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.core.named import find_actor
from raykv.engine.polling import ActorLiveness
from raykv.engine.primary import PrimaryRegion
from raykv.engine.reattach import TierReattach, actor_gone, restarted
from raykv.engine.tier_driver import TierDriver
from tests.cli_run import run_raykv
from tests.waiting import wait_until

NAMESPACE = "raykv-reattach-test"


def test_a_tier_attaches_to_raykv_started_again(ray_local) -> None:
    services = raykv.start({"namespace": NAMESPACE, "directory_shards": 2})
    region = PrimaryRegion(16, 4096)
    make = lambda: TierFactory.create_tier({"type": "object_store", "namespace": NAMESPACE}, region.view)  # noqa: E731
    tier = make()
    reattach = TierReattach(make, "object_store tier")
    keys = prefix_keys(list(range(8 * 16)), 16)
    assert TierDriver(tier).store(keys[:4], [0, 1, 2, 3]).success
    tier.on_new_request(_ctx("warm"))  # the policy cache (and its long poll) starts with the first request
    assert reattach.poll(tier) is None and not restarted(tier)

    address = ray.get_runtime_context().gcs_address
    stopped = run_raykv("stop", namespace=NAMESPACE, address=address)  # from another process, as an operator
    assert stopped.returncode == 0, stopped.stderr
    policy = services.policy
    wait_until(lambda: policy.control_gone, timeout_s=20.0, what="the policy long poll to see raykv stopped")
    tier.submit_store(  # fails: nobody to store to
        TransferJob(job_id=7, keys=keys[4:6], chunk_ids=np.array([4, 5]), is_promotion=False, req_context=_ctx("s"))
    )
    for _ in range(5):  # stopped, not started again: the tier stays as it is
        assert reattach.poll(tier) is None
    assert not restarted(tier)

    started = run_raykv("start", namespace=NAMESPACE, address=address)
    assert started.returncode == 0, started.stderr
    wait_until(lambda: restarted(tier), timeout_s=20.0, what="the policy long poll to find raykv started again")
    new = wait_until(lambda: reattach.poll(tier), timeout_s=30.0, what="the tier built anew")
    assert new is not tier and reattach.reattached == 1
    assert raykv.attach(NAMESPACE) is new.services is not services

    results = wait_until(lambda: list(reattach.finished_jobs()), timeout_s=30.0, what="the old tier's store result")
    assert [(r.job_id, r.success) for r in results] == [(7, False)]

    def retired() -> bool:  # as the engine does each step: take results, which retires the old tier
        assert list(reattach.finished_jobs()) == []  # every job ended once
        return not reattach.has_pending_work()

    wait_until(retired, timeout_s=40.0, what="the old tier retired")

    assert TierDriver(new).store(keys[:4], [0, 1, 2, 3]).success
    assert new.lookup_blocking(keys[:5]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
    new.shutdown()
    region.close()
    raykv.attach(NAMESPACE).shutdown()


@pytest.mark.parametrize("tier_type", ["object_store", "fs"])
def test_a_tier_whose_actor_was_killed_for_good_is_built_anew(ray_local, tmp_path, tier_type) -> None:
    """``ray.kill`` (no restart) of the node's object store actor or of the fs root actor while
    raykv runs: the tier is built anew and starts its successor; stores and loads work again.
    After ``raykv stop``, a dead actor is left alone (the tier attaches once raykv is started)."""
    namespace = f"{NAMESPACE}-killed-{tier_type.replace('_', '-')}"
    services = raykv.start({"namespace": namespace, "directory_shards": 2})
    config: dict[str, object] = {"type": tier_type, "namespace": namespace}
    if tier_type == "fs":
        config["root"] = str(tmp_path / "kv")
    region = PrimaryRegion(16, 4096)
    region.array[:] = np.random.default_rng(7).integers(0, 256, region.array.shape, dtype=np.uint8)
    make = lambda: TierFactory.create_tier(config, region.view)  # noqa: E731
    tier = make()
    reattach = TierReattach(make, f"{tier_type} tier")
    keys = prefix_keys(list(range(8 * 16)), 16)
    assert TierDriver(tier).store(keys[:4], [0, 1, 2, 3]).success
    old_actor = tier.actor

    ray.kill(old_actor)  # Ray's default: no restart

    def rebuilt():
        tier.on_schedule_end()  # an engine step: polls the actor's liveness
        return reattach.poll(tier)

    new = wait_until(rebuilt, timeout_s=30.0, what="the tier built anew after its actor was killed")
    assert actor_gone(tier) and not restarted(tier)
    assert (reattach.actor_replaced, reattach.reattached) == (1, 0)
    assert new.services is services and new.actor != old_actor
    assert ray.get(new.actor.raykv_ping.remote(), timeout=30)  # its successor runs

    driver = TierDriver(new)
    assert driver.store(keys[4:8], [4, 5, 6, 7]).success
    assert driver.lookup(keys[4:8]) == [LookupResult.HIT] * 4
    assert driver.load(keys[4:8], [12, 13, 14, 15]).success
    assert np.array_equal(region.array[12:16], region.array[4:8])
    if tier_type == "fs":  # the files outlived the actor: its successor found them
        wait_until(
            lambda: driver.lookup(keys[:4]) == [LookupResult.HIT] * 4, timeout_s=30.0, what="the old files listed"
        )
        assert driver.load(keys[:4], [8, 9, 10, 11]).success
        assert np.array_equal(region.array[8:12], region.array[0:4])
    wait_until(
        lambda: not list(reattach.finished_jobs()) and not reattach.has_pending_work(),
        timeout_s=40.0,
        what="the old tier retired",
    )

    services.shutdown()  # raykv stop: the new actor dies too, and is not started again
    deadline = time.monotonic() + 2 * ActorLiveness.GONE_CHECK_S + 2.0
    while time.monotonic() < deadline:
        new.on_schedule_end()
        assert reattach.poll(new) is None
        time.sleep(0.05)
    assert not new.holder_alive and not actor_gone(new)
    assert find_actor(new.holder_info.actor_name, namespace) is None
    new.shutdown()
    region.close()


def _ctx(req_id: str) -> ReqContext:
    return ReqContext(req_id)
