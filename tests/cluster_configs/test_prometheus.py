"""A real Prometheus evaluates every panel query of the raykv Grafana dashboard.

Debian's ``prometheus`` scrapes a real two-node Ray cluster through the
service-discovery file Ray's dashboard writes into the session directory
(``prom_metrics_service_discovery.json``, one target per node's metrics port),
traffic runs through raykv's object_store (on both nodes) and fs tiers, and
each panel target of ``cluster_configs/grafana_raykv.json`` is sent to
Prometheus's HTTP API (``/api/v1/query``), as Grafana would: each must return
data. Skips only when no ``prometheus`` binary exists (``RAYKV_REQUIRE_PROMETHEUS``
turns that into a failure; ``.ci/run`` installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

import raykv
from tests.waiting import WaitTimeout, wait_until

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster_configs" / "grafana_raykv.json"
NAMESPACE = "raykv-prometheus-test"
BLOCK = 64 * 1024
SD_FILE = "prom_metrics_service_discovery.json"


def _panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows included."""
    out = []

    def walk(items: list[dict[str, Any]]) -> None:
        for p in items:
            walk(p.get("panels", []))
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


@ray.remote(num_cpus=0)
class Engine:
    """An engine-side client of the object_store and fs tiers over its own primary region."""

    def __init__(self, root: str) -> None:
        from raykv.core.factory import TierFactory
        from raykv.engine.primary import PrimaryRegion

        self.region = PrimaryRegion(32, BLOCK)
        self.region.array[:] = np.random.default_rng(0).integers(0, 256, self.region.array.shape, dtype=np.uint8)
        services = raykv.attach(NAMESPACE)
        self.tiers = {
            "object_store": TierFactory.create_tier({"type": "object_store"}, self.region.view, services=services),
            "fs": TierFactory.create_tier(
                {"type": "fs", "root": root, "capacity_bytes": 12 * (BLOCK + 4096), "fsync": False},
                self.region.view,
                services=services,
            ),
        }

    def run(self, tier: str, op: str, keys: list[bytes], slots: list[int]) -> Any:
        from raykv.engine.tier_driver import TierDriver

        drv = TierDriver(self.tiers[tier])
        if op == "lookup":
            out: Any = [r.name for r in drv.lookup(keys)]
        elif op == "past_budget":  # an engine's request whose RETRY budget is spent: unknown keys answer MISS
            from raykv.core.contract import ReqContext

            req = ReqContext("past-budget", retry_budget_s=0.0)
            out = [self.tiers[tier].lookup(k, req).name for k in keys]
        elif op == "store":
            out = drv.store(keys, slots).success
        elif op == "store_pinned":  # a request with kv_transfer_params {"cache_ttl_s": 600}
            from raykv.core.contract import ReqContext

            drv = TierDriver(self.tiers[tier], "pinned")
            drv.req = ReqContext("pinned", {"cache_ttl_s": 600})
            out = drv.store(keys, slots).success
        else:
            self.tiers[tier]._cache.invalidate(keys)  # ask the directory again, as a fresh engine would
            drv.lookup(keys)
            out = drv.load(keys, slots, timeout=30).success
        self.tiers[tier].on_schedule_end()  # flush the engine-side metrics
        return out

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.shutdown()
        self.region.close()

    def routed(self, seconds: float, by_source: dict[str, int]) -> None:
        """What raykv's request router records per routed request (``raykv.serve.router``;
        a Serve app with real engines is tests/raykv/serve/test_router.py's)."""
        from raykv.metrics.catalog import record

        record("raykv_router_decision_seconds", seconds, {"deployment": "LLMServer:test"})
        record("raykv_router_decision_cpu_seconds", seconds / 2, {"deployment": "LLMServer:test"})
        for stage in ("tokenize", "hash", "directory", "rank"):
            record("raykv_router_stage_seconds", seconds / 4, {"deployment": "LLMServer:test", "stage": stage})
        for source, tokens in by_source.items():
            record("raykv_router_prompt_tokens", tokens, {"deployment": "LLMServer:test", "source": source})
        record("raykv_router_fallbacks", 1, {"deployment": "LLMServer:test", "reason": "error"})

    def dropped(self, blocks: int) -> None:
        """What raykv's cascade-drop counter records for a request whose refused
        blocks never reached the primary (``raykv.integrations.vllm.drops``; a real
        engine's drops are tests/integrations/vllm/test_cascade_drops.py's)."""
        from raykv.integrations.vllm.drops import METRIC
        from raykv.metrics.catalog import record

        record(METRIC, blocks, {"node": ray.get_runtime_context().get_node_id(), "namespace": NAMESPACE})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, free_port, make_ray_cluster):
    """Two real Ray nodes, the head with its dashboard (which writes the service-discovery file);
    yields this session's directory and an fs root."""
    make_ray_cluster(
        head={
            "num_cpus": 1,
            "resources": {"node_a": 1},
            "object_store_memory": 128 << 20,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
            "_system_config": {"metrics_report_interval_ms": 500},
        },
        workers=[{"num_cpus": 1, "resources": {"node_b": 1}, "object_store_memory": 128 << 20}],
    )
    root = str(tmp_path_factory.mktemp("fs-root"))
    services = raykv.start(
        {
            "namespace": NAMESPACE,
            "directory_shards": 2,
            "tiers": [{"type": "object_store", "capacity_bytes": 12 * BLOCK}],
            "pending_entries": True,  # the lookups past their budget announce what they compute
            "agent_view_all_keys": False,  # lookups of unknown keys are waited for: every lookup panel has data
        }
    )
    ctx = ray.get_runtime_context()  # this session's dir is <temp dir>/<session name>
    yield Path(ctx.get_temp_dir(), ctx.get_session_name()), root
    services.shutdown()


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory, free_port, system_binary):
    """Debian's prometheus scraping every Ray node once a second; yields its base URL."""
    binary = system_binary(
        ("prometheus",), "RAYKV_PROMETHEUS", "RAYKV_REQUIRE_PROMETHEUS", "Debian: apt-get install -y prometheus"
    )
    session_dir, _ = cluster
    sd_file = session_dir / SD_FILE
    wait_until(sd_file.exists, timeout_s=30, interval_s=0.5, what=f"Ray to write {sd_file}")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n- job_name: ray\n  file_sd_configs:\n"
        f"  - files: ['{sd_file}']\n    refresh_interval: 1s\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(work / "prometheus.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200

    try:
        wait_until(ready, timeout_s=30, interval_s=0.3, ignore=(OSError,), what="prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"prometheus refused {expr!r}: {e.read().decode()[:500]}") from e
    assert body["status"] == "success", body
    return body["data"]["result"]


def _traffic(root: str) -> None:
    """Hits, misses, failed loads, evictions, a cross-node pull, a corrupt file, and
    lookups past a request's RETRY budget; every driver call is an engine step."""
    a = Engine.options(resources={"node_a": 0.01}).remote(root)
    b = Engine.options(resources={"node_b": 0.01}).remote(root)
    try:
        for tier in ("object_store", "fs"):
            keys = raykv.prefix_keys(list(range(16 * 20)), 16, salt=tier)  # 20 blocks
            assert ray.get(a.run.remote(tier, "store", keys[:8], list(range(8))))
            assert ray.get(a.run.remote(tier, "lookup", keys[:10], [])) == ["HIT"] * 8 + ["MISS"] * 2
            assert ray.get(a.run.remote(tier, "load", keys[:4], list(range(20, 24))))
            assert ray.get(b.run.remote(tier, "load", keys[:4], list(range(20, 24))))  # object_store: a remote pull
            assert not ray.get(a.run.remote(tier, "load", keys[18:20], [24, 25]))  # never stored: a failed job
            assert ray.get(a.run.remote(tier, "store", keys[8:18], list(range(8, 18))))  # over capacity: evictions
        # Pins: the tier caps 6 of 12 blocks (max_pinned_fraction 0.5). Each store's blocks are
        # pinned together (one pack), so the fourth 2-block store is refused: stored unpinned.
        pinned = raykv.prefix_keys(list(range(16 * 8)), 16, salt="pinned")
        for i in range(0, 8, 2):
            assert ray.get(a.run.remote("object_store", "store_pinned", pinned[i : i + 2], [i, i + 1]))
        fresh = raykv.prefix_keys(list(range(16 * 4)), 16, salt="past-budget")
        assert ray.get(a.run.remote("object_store", "past_budget", fresh, [])) == ["MISS"] * 4
        from raykv.core.identity import scoped_keys
        from tiers.fs.storage import open_storage

        # A corrupt block file: the load fails and the root actor drops the key.
        keys = raykv.prefix_keys(list(range(16 * 20)), 16, salt="fs")
        path = open_storage(root).path_of(scoped_keys(keys[17:18])[0])  # stored under the default identity
        with open(path, "r+b") as f:
            f.seek(-16, os.SEEK_END)
            f.write(b"\xff" * 16)
        assert not ray.get(a.run.remote("fs", "load", keys[17:18], [26]))
        for _ in range(3):
            ray.get(a.routed.remote(0.004, {"engine": 512, "raykv": 256, "recompute": 128}))
            ray.get(a.dropped.remote(2))
    finally:
        ray.get([a.close.remote(), b.close.remote()])


def test_every_dashboard_panel_returns_data_from_prometheus(cluster, prometheus) -> None:
    session_dir, root = cluster
    _traffic(root)
    session = session_dir.name  # session_<date>_<pid>: only characters a regex takes literally
    assert re.fullmatch(r"[\w-]+", session), session
    queries = _panel_queries()
    assert len(queries) >= 20
    empty: list[str] = []

    def every_panel_has_data() -> bool:
        nonlocal empty
        empty = [
            f"{title}: {expr}" for title, expr in queries if not _query(prometheus, expr.replace("$session", session))
        ]
        return not empty

    with contextlib.suppress(WaitTimeout):  # the assertion below names the panels still empty
        wait_until(every_panel_has_data, timeout_s=90, interval_s=2, what="data for every dashboard panel")
    assert not empty, "panel queries with no data:\n" + "\n".join(empty)
    # And the numbers are the traffic's, not zeros: stored bytes, hits, and a remote pull.
    held = _query(prometheus, f'sum by (tier) (ray_raykv_tier_bytes{{SessionName=~"{session}"}})')
    assert {r["metric"]["tier"] for r in held if float(r["value"][1]) > 0} == {"object_store", "fs"}
    hits = _query(prometheus, f'sum by (tier) (ray_raykv_lookup_hits_total{{SessionName=~"{session}"}})')
    assert {r["metric"]["tier"]: float(r["value"][1]) >= 8 for r in hits} == {"object_store": True, "fs": True}
    remote = _query(prometheus, f'sum(ray_raykv_object_store_served_remote_blocks_total{{SessionName=~"{session}"}})')
    assert float(remote[0]["value"][1]) >= 4
    pinned = _query(prometheus, f'sum by (tenant) (ray_raykv_tier_pinned_bytes{{SessionName=~"{session}"}})')
    assert {r["metric"]["tenant"]: float(r["value"][1]) for r in pinned} == {"(none)": 6 * BLOCK}
    refused = _query(prometheus, f'sum by (reason) (ray_raykv_tier_pins_refused_total{{SessionName=~"{session}"}})')
    assert {r["metric"]["reason"]: float(r["value"][1]) for r in refused} == {"tier_cap": 2}
