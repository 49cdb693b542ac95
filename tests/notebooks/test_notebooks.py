"""Both notebooks run top to bottom in a real Jupyter kernel (so they cannot rot;
``make test-e2e``, which CI runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nbformat
import pytest
import ray
from nbclient import NotebookClient

import raykv
from raykv.core.factory import TierFactory
from raykv.core.keys import prefix_keys
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tests.clusters import start_local_ray

# Whole runs of the product, as `raykv demo` is: `make test-e2e`.
pytestmark = pytest.mark.e2e

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NS = "raykv-inspect-test"


def _run(name: str, tmp_path: Path, timeout: int = 120) -> nbformat.NotebookNode:
    """Execute ``notebooks/<name>`` in a fresh kernel; raises on the first failing cell."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return nb


def _outputs(nb: nbformat.NotebookNode) -> tuple[str, list[dict[str, Any]]]:
    # A kernel may send one print's text as several stream messages (it flushes on a
    # timer): stream texts join as they came, each carrying its own newlines.
    text, data = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif "data" in out:
                data.append(out["data"])
                text.append("\n" + out["data"].get("text/plain", "") + "\n")
        text.append("\n")
    return "".join(text), data


def _line(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :].strip()


def test_quickstart(tmp_path: Path) -> None:
    if ray.is_initialized():
        ray.shutdown()  # the notebook starts its own local Ray
    nb = _run("quickstart.ipynb", tmp_path)
    text, data = _outputs(nb)
    summary = json.loads(_line(text, "SUMMARY"))
    rates = summary["final_hit_rate"]
    assert set(rates) == {"example", "object_store", "fs"}
    assert rates["fs"] > 0.8 and rates["example"] > 0.8  # the last turn reuses the whole context
    assert 0 < rates["object_store"] < rates["fs"]  # its 48 blocks evict part of it
    assert 0.75 < summary["occupancy"]["object_store"] <= 1.0  # full (LRU evicts whole packs)
    assert summary["directory_keys"] > 48
    assert sum("image/png" in d for d in data) >= 1, "no plot"


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory):
    """A 'running cluster': local Ray, raykv with blocks in the object_store and fs tiers."""
    ctx = start_local_ray(
        num_cpus=2,
        object_store_memory=256 << 20,
        _system_config={"metrics_report_interval_ms": 500},
    )
    root = str(tmp_path_factory.mktemp("fs-root"))
    services = raykv.start({"namespace": NS, "directory_shards": 2})
    region = PrimaryRegion(16, 32 * 1024)
    keys = prefix_keys(list(range(16 * 12)), 16)
    for cfg in ({"type": "object_store"}, {"type": "fs", "root": root, "fsync": False}):
        tier = TierFactory.create_tier(cfg, region.view, services=services)
        drv = TierDriver(tier)
        n = 12 if cfg["type"] == "object_store" else 5
        assert drv.store(keys[:n], list(range(n))).success
        drv.lookup(keys)
        tier.on_schedule_end()
        tier.shutdown()
    region.close()
    yield ctx.address_info["gcs_address"], root
    services.shutdown()
    ray.shutdown()


def test_inspect_cluster(running_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address, root = running_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAYKV_NAMESPACE", NS)
    nb = _run("inspect_cluster.ipynb", tmp_path)
    text, data = _outputs(nb)
    assert f"connected to {address}" in text
    inspected = json.loads(_line(text, "INSPECTED"))
    assert inspected["tiers"] == 2 and inspected["directory_keys"] == 12
    holders = inspected["holders"]
    node = ray.get_runtime_context().get_node_id()
    assert holders[f"object_store:{node}"] == 12 and sum(holders.values()) == 17
    assert "keys held by more than one tier: 5" in text
    assert root[:30] in text  # the fs tier's root in the status table (cut to its column)
    assert sum("image/png" in d for d in data) >= 2, "no plots"
