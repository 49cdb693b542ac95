"""``raykv unpin`` in a subprocess against a real local Ray: pins of one tenant,
then every pin, go from the object store and fs tiers (the blocks stay), and
``raykv status`` shows the pinned bytes per tenant before; naming nothing is a
clear error."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import ray

import raykv
from raykv.core.contract import ReqContext
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.cli_run import run_raykv

BLOCK = 32 * 1024
NS = "raykv-unpin-test"


def _raykv(*args: str) -> subprocess.CompletedProcess:
    return run_raykv(*args, namespace=NS, address=ray.get_runtime_context().gcs_address)


def _about(pinned: dict[str, int], blocks: dict[str, int]) -> bool:
    """Pinned bytes per tenant are these blocks' (an fs file adds a small header to each)."""
    return set(pinned) == set(blocks) and all(0 <= pinned[t] - n * BLOCK < n * 1024 for t, n in blocks.items())


def _figures(tier) -> dict:
    """A tier's stats figures, with its block count as ``blocks`` (the fs root counts ``files``)."""
    figures = dict(tier.stats().figures)
    figures.setdefault("blocks", figures.get("files"))
    return figures


@pytest.fixture(scope="module")
def pinned(ray_local, tmp_path_factory):
    """Per tier: 3 blocks pinned by tenant-a, 2 by tenant-b, 2 unpinned; the tiers' stats readers."""
    services = raykv.start({"namespace": NS, "directory_shards": 1})
    region = PrimaryRegion(8, BLOCK)
    region.array[:] = np.random.default_rng(3).integers(0, 256, region.array.shape, dtype=np.uint8)
    root = str(tmp_path_factory.mktemp("fs-root"))
    configs = {
        "object_store": {"type": "object_store", "capacity_bytes": 64 * BLOCK},
        "fs": {"type": "fs", "root": root, "capacity_bytes": 64 * BLOCK, "fsync": False},
    }
    tiers = {}
    for name, cfg in configs.items():
        tier = tiers[name] = TierFactory.create_tier(cfg, region.view, services=services)
        for tenant, n, ttl in (("tenant-a", 3, 600), ("tenant-b", 2, 600), ("tenant-a", 2, None)):
            drv = TierDriver(tier, f"{tenant}-{ttl}")
            params = {"tenant": tenant, **({"cache_ttl_s": ttl} if ttl else {})}
            drv.req = ReqContext(drv.req.req_id, params, tenant=tenant)
            keys = prefix_keys(list(range(16 * n)), 16, salt=f"{name}-{tenant}-{ttl}")
            assert drv.store(keys, list(range(n))).success
    yield {name: (lambda t=t: _figures(t)) for name, t in tiers.items()}
    for tier in tiers.values():
        tier.shutdown()
    region.close()
    services.shutdown()


def test_unpin_by_tenant_then_all_keeps_the_blocks(pinned) -> None:
    for figures in pinned.values():
        f = figures()
        assert f["pinned_blocks"] == 5 and f["blocks"] == 7
        assert _about(f["tenant_pinned_bytes"], {"tenant-a": 3, "tenant-b": 2}), f["tenant_pinned_bytes"]

    status = _raykv("status", "--no-metrics")
    assert status.returncode == 0, status.stderr
    assert "pinned bytes per tenant (cache_ttl_s):" in status.stdout
    assert "tenant-a 96.0 KiB, tenant-b 64.0 KiB" in status.stdout, status.stdout
    rows = json.loads(_raykv("status", "--json", "--no-metrics").stdout)["tiers"]
    for row in rows:
        if row["tier_type"] in pinned:
            assert _about(row["tenant_pinned_bytes"], {"tenant-a": 3, "tenant-b": 2}), row
            assert 0 < row["pin_expiries"][0]["seconds_left"] <= 600

    out = _raykv("unpin", "--tenant", "tenant-a")
    assert out.returncode == 0, out.stderr
    assert "unpinned 6 blocks (tenant 'tenant-a')" in out.stdout, out.stdout  # 3 per tier
    for figures in pinned.values():
        f = figures()
        assert _about(f["tenant_pinned_bytes"], {"tenant-b": 2}) and f["blocks"] == 7, f

    out = _raykv("unpin", "--all", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["blocks_unpinned"] == 4
    for figures in pinned.values():
        f = figures()
        assert f["pinned_blocks"] == 0 and f["pinned_bytes"] == 0 and f["blocks"] == 7


def test_unpin_naming_nothing_is_a_clear_error(pinned) -> None:
    out = _raykv("unpin")
    assert out.returncode == 2
    assert "raykv: error: raykv unpin: name what to unpin: --tenant NAME" in out.stderr, out.stderr
    out = _raykv("unpin", "--key", "xyz")
    assert out.returncode == 2 and "--key: must be a scoped tier key in hex, got 'xyz'" in out.stderr, out.stderr
