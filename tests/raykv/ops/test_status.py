"""``raykv status``: the JSON and the table report what the test put in the tiers; a clear error without Ray."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time

import numpy as np
import pytest
import ray

import raykv
from raykv.core.contract import LookupResult
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from raykv.metrics import scrape
from raykv.ops.status import collect_status, format_status
from tests.cli_run import run_raykv
from tests.clusters import start_local_ray
from tests.waiting import WaitTimeout, wait_until

BLOCK = 32 * 1024
NS = "raykv-status-test"
OS_CAPACITY = 64 * BLOCK


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "command",
    [("status", "--json"), ("start",), ("stop",), ("invalidate", "--model", "m"), ("unpin", "--all")],
    ids=lambda c: c[0],
)
def test_a_command_without_a_reachable_cluster_says_so_at_once(command: tuple[str, ...]) -> None:
    port = _closed_port()
    t0 = time.monotonic()
    out = run_raykv(*command, "--address", f"127.0.0.1:{port}")
    assert out.returncode == 2, out
    assert f"raykv: error: no Ray cluster reachable at address='127.0.0.1:{port}'" in out.stderr
    assert "ray start --head" in out.stderr
    assert out.stdout == ""
    assert time.monotonic() - t0 < 30  # not Ray's minute of GCS retries


def test_status_reads_the_address_from_ray_address() -> None:
    port = _closed_port()
    # The address from RAY_ADDRESS (what `ray` itself reads) gets the same check.
    out = run_raykv("status", env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert out.returncode == 2, out
    assert f"raykv: error: no Ray cluster reachable at address='127.0.0.1:{port}'" in out.stderr


def test_a_malformed_address_is_named_before_ray_is_asked() -> None:
    out = run_raykv("start", "--address", "head-node")  # no port: Ray would fail on it later
    assert out.returncode == 2, out
    assert out.stderr.strip() == (
        "raykv: error: address: must be a Ray address such as 'auto' or 'host:6379', got 'head-node'"
    )


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A local Ray with raykv, 10 blocks in the object store tier and 6 in the fs tier, and lookups."""
    start_local_ray(
        num_cpus=2,
        object_store_memory=256 << 20,
        _system_config={"metrics_report_interval_ms": 500},
    )
    root = str(tmp_path_factory.mktemp("fs-root"))
    # Views of asked keys only, so the engines' lookups reach the agent and its figures show them.
    services = raykv.start({"namespace": NS, "directory_shards": 3, "agent_view_all_keys": False})
    region = PrimaryRegion(32, BLOCK)
    region.array[:] = np.random.default_rng(1).integers(0, 256, region.array.shape, dtype=np.uint8)
    totals = {}
    placed = {"object_store": 10, "fs": 6}
    configs = {
        "object_store": {"type": "object_store", "capacity_bytes": OS_CAPACITY},
        "fs": {"type": "fs", "root": root, "capacity_bytes": 0, "fsync": False},
    }
    for name, cfg in configs.items():
        tier = TierFactory.create_tier(cfg, region.view, services=services)
        drv = TierDriver(tier)
        keys = prefix_keys(list(range(16 * 12)), 16, salt=name)
        n = placed[name]
        assert drv.store(keys[:n], list(range(n))).success
        assert drv.lookup(keys) == [LookupResult.HIT] * n + [LookupResult.MISS] * (12 - n)
        tier.on_schedule_end()
        totals[name] = dict(tier.metrics.totals)
        tier.shutdown()
    region.close()
    # Wait until the node's metrics port shows the engines' lookups (exported every 0.5 s).
    with contextlib.suppress(WaitTimeout):  # the tests assert on the numbers themselves
        wait_until(
            lambda: all(
                scrape.sum_series(scrape.scrape_cluster(), "ray_raykv_lookups_total", "tier").get(t)
                == totals[t]["raykv_lookups"]
                for t in totals
            ),
            timeout_s=20,
            interval_s=0.5,
            what="the engines' lookups on the node's metrics port",
        )
    yield services, root, placed, totals
    services.shutdown()
    ray.shutdown()


def _check(status: dict, root: str, placed: dict[str, int], totals: dict) -> None:
    node = ray.get_runtime_context().get_node_id()
    assert status["namespace"] == NS
    tiers = {t["tier_type"]: t for t in status["tiers"]}
    assert set(tiers) == {"object_store", "fs"}
    os_tier, fs_tier = tiers["object_store"], tiers["fs"]
    assert os_tier["node_id"] == node and os_tier["alive"]
    assert os_tier["blocks"] == 10 and os_tier["bytes_used"] == 10 * BLOCK
    assert os_tier["capacity_bytes"] == OS_CAPACITY
    assert os_tier["occupancy"] == pytest.approx(10 / 64)
    assert fs_tier["alive"] and fs_tier["stats"]["root"] == root
    assert fs_tier["blocks"] == 6 and fs_tier["bytes_used"] > 6 * BLOCK
    assert fs_tier["capacity_bytes"] == 0 and fs_tier["occupancy"] is None  # unlimited
    assert status["directory"]["shards"] == 3
    assert status["directory"]["keys"] == sum(placed.values())
    assert sum(status["directory"]["keys_per_shard"]) == 16
    services = {s["name"]: s for s in status["services"]}
    assert set(services) == {"raykv-control", "raykv-directory-0", "raykv-directory-1", "raykv-directory-2"}
    assert all(s["alive"] for s in services.values())
    for tier in ("object_store", "fs"):
        rate = status["hit_rates"][tier]
        assert rate["lookups"] == totals[tier]["raykv_lookups"]
        assert rate["hits"] == totals[tier]["raykv_lookup_hits"]
        assert 0 < rate["hit_rate"] < 1
    assert os_tier["engine_lookups"]["lookups"] == totals["object_store"]["raykv_lookups"]
    # the node's directory agent: the tiers' lookups and registrations went through it
    (agent,) = status["agents"]
    assert agent["node_id"] == node and agent["alive"] and agent["window_ms"] == 2.0
    assert agent["local_keys"] == placed["object_store"]  # the node's object store; the fs root is no node's
    assert agent["view_keys"] >= agent["local_keys"] and agent["view_bytes"] > 0
    assert agent["engine_calls"] > 0 and agent["shard_calls"] > 0 and agent["resets"] == 0
    assert agent["view"] == "asked"  # this namespace's views keep own and asked keys only
    # the tiers here run under the default identity: all 16 blocks are its, per tier
    (ident,) = status["identities"]
    assert ident["model"] == "default" and ident["blocks"] == 16
    assert ident["blocks_by_tier"] == {"object_store": 10, "fs": 6}


def test_status_json_reports_tiers_and_occupancy(filled) -> None:
    services, root, placed, totals = filled
    address = ray.get_runtime_context().gcs_address
    # As from a user's shell after `ray start --head`: no RAY_AUTH_MODE (this process's Ray
    # set it), an explicit address, the cluster's token in ~/.ray/auth_token. The address is
    # given as --address, then in RAY_ADDRESS alone (ray.init takes it as an explicit one).
    for flag, env in ((address, {}), (None, {"RAY_ADDRESS": address})):
        t0 = time.monotonic()
        out = run_raykv("status", "--json", "--namespace", NS, address=flag, env={"RAY_AUTH_MODE": None, **env})
        assert out.returncode == 0, out.stderr[-3000:]
        assert time.monotonic() - t0 < 15  # not 20 s of retries without the token first
        assert "Token authentication is enabled" not in out.stderr
        _check(json.loads(out.stdout), root, placed, totals)


def test_status_table(filled) -> None:
    services, root, placed, totals = filled
    status = collect_status(services)
    _check(status, root, placed, totals)
    table = format_status(status)
    node = ray.get_runtime_context().get_node_id()
    os_row = next(line for line in table.splitlines() if line.startswith("object_store "))
    assert node[:30] in os_row and " 10 " in os_row and "16%" in os_row
    fs_row = next(line for line in table.splitlines() if line.startswith("fs "))
    assert "unlimited" in fs_row and " 6 " in fs_row
    assert "directory: 3 shard(s), 16 keys" in table
    assert "raykv-directory-2" in table
    agent_row = next(line for line in table.splitlines() if line.startswith(node[:22]))
    assert agent_row.split()[1] == "yes" and "2.0ms" in agent_row and agent_row.split()[3] == "asked"
    ident_row = next(line for line in table.splitlines() if line.startswith(status["identities"][0]["tag"]))
    assert " 16 " in ident_row and "default" in ident_row and "object_store 10" in ident_row


def _pid(actor) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def test_status_asks_every_actor_at_once_so_hung_ones_cost_one_timeout(filled) -> None:
    """Hung actors (SIGSTOP: a process stuck in a system call, a node swapping) are reported
    as not answering, and `raykv status` waits one timeout for all of them, not one each."""
    services, _root, _placed, _totals = filled
    (os_info,) = [h for h in services.holders() if h.tier_type == "object_store"]
    hung = [*services.directory.shards[1:], ray.get_actor(os_info.actor_name, namespace=NS)]
    pids = [_pid(actor) for actor in hung]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status = collect_status(services, timeout=2.0, metrics=False)
        took = time.monotonic() - t0
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert took < 4.0, took  # one 2 s timeout (before: 2 s for each of the 3 hung actors)
    rows = {s["name"]: s for s in status["services"]}
    assert [rows[f"raykv-directory-{i}"]["alive"] for i in range(3)] == [True, False, False]
    assert rows["raykv-directory-2"]["error"] == "no answer in 2 s"
    tiers = {t["tier_type"]: t for t in status["tiers"]}
    assert not tiers["object_store"]["alive"] and tiers["object_store"]["error"] == "no answer in 2 s"
    assert tiers["fs"]["alive"] and tiers["fs"]["blocks"] == 6
    table = format_status(status)
    assert next(line for line in table.splitlines() if line.startswith("raykv-directory-1 ")).endswith(
        "  no answer in 2 s"
    )
