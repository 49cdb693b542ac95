"""Policy negotiation: rules registered at the directory reach engines, and
``on_new_request`` answers from memory."""

from __future__ import annotations

import time

import pytest
import ray

from raykv.core.contract import OffloadPolicy, ReqContext
from raykv.policy import PolicyRule


def _calls(services) -> int:
    control = sum(ray.get(services.control.stats.remote()).calls.values())
    shards = sum(sum(s.calls.values()) for s in services.directory.stats())
    return control + shards


def test_request_level_rule_reaches_engine_without_per_request_calls(raykv_services):
    policy = raykv_services.policy  # engine-side cache; starts its long poll
    persist = ReqContext("r-persist", kv_transfer_params={"persist": True})
    plain = ReqContext("r-plain", kv_transfer_params={"persist": False})
    assert policy.decide("fs", persist).policy is OffloadPolicy.CHUNK_LEVEL

    t0 = time.monotonic()
    version = raykv_services.add_rule(
        {"name": "persist-to-fs", "tier": "fs", "match": {"kv_transfer_params": {"persist": True}}}
    )
    assert policy.wait_version(version, timeout=5)
    print(f"rule reached the engine in {(time.monotonic() - t0) * 1000:.1f} ms")

    before = _calls(raykv_services)
    decisions = [policy.decide("fs", persist if i % 2 else plain) for i in range(2000)]
    after = _calls(raykv_services)
    # 2000 decisions, at most the background long poll's own call or two
    assert after - before <= 2, f"{after - before} directory calls for 2000 requests"
    assert {d.policy for d in decisions[1::2]} == {OffloadPolicy.REQUEST_LEVEL}
    assert {d.policy for d in decisions[0::2]} == {OffloadPolicy.CHUNK_LEVEL}
    assert decisions[1].request_level_tiers == {"fs"}
    # the rule is for fs only
    assert policy.decide("object_store", persist).policy is OffloadPolicy.CHUNK_LEVEL

    version = raykv_services.remove_rule("persist-to-fs")
    assert policy.wait_version(version, timeout=5)
    assert policy.decide("fs", persist).policy is OffloadPolicy.CHUNK_LEVEL


def test_tenant_rule():
    rule = PolicyRule.from_dict({"tier": "*", "policy": "REQUEST_LEVEL", "match": {"tenant": "acme"}})
    assert rule.matches("fs", ReqContext("a", tenant="acme"))
    assert rule.matches("object_store", ReqContext("b", kv_transfer_params={"tenant": "acme"}))
    assert not rule.matches("fs", ReqContext("c", tenant="other"))
    assert not rule.matches("fs", ReqContext("d"))


def test_bad_rule_rejected_at_the_directory(raykv_services):
    with pytest.raises(Exception, match=r"policy: must be one of"):
        raykv_services.add_rule({"tier": "fs", "policy": "always"})


def test_shutdown_ends_the_policy_thread(ray_local):
    """The long-poll thread is gone when ``shutdown`` returns: one left inside a
    Ray call when the process runs ``ray.shutdown()`` can crash the process."""
    import raykv

    services = raykv.start({"namespace": "raykv-policy-stop", "directory_shards": 1})
    policy = services.policy
    assert policy.wait_version(0, timeout=30), "the long poll never answered"
    t0 = time.monotonic()
    services.shutdown()
    took = time.monotonic() - t0
    print(f"\nshutdown with a live policy long poll: {1000 * took:.0f} ms")
    assert not policy.refreshing, "the policy thread outlived shutdown"
