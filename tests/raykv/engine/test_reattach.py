"""After ``raykv stop`` and ``raykv start``, an engine's tier is built again from its config
and swapped in (``raykv.engine.reattach``); the old tier's jobs each still end in one
result. Real local Ray, real object store tier; the vLLM path is in
``tests/integrations/vllm/test_raykv_tiers.py``."""

from __future__ import annotations

import numpy as np
import ray

import raykv
from raykv.core.contract import LookupResult, ReqContext, TransferJob
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.reattach import TierReattach, restarted
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


def _ctx(req_id: str) -> ReqContext:
    return ReqContext(req_id)
