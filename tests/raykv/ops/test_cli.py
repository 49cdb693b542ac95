"""``raykv vllm-config``: sizes in bytes as a user types them, on the command line and in a config file."""

from __future__ import annotations

import json

from tests.cli_run import run_raykv


def test_vllm_config_takes_sizes(tmp_path) -> None:
    cfg = tmp_path / "raykv.yaml"
    cfg.write_text(
        "tiers:\n"
        "  - {type: object_store, capacity_bytes: 512MiB}\n"
        f"  - {{type: fs, root: {tmp_path / 'kv'}, capacity_bytes: 1e9, tenant_quotas: {{team-a: 64Gi}}}}\n"
    )
    p = run_raykv("vllm-config", "--config", str(cfg), "--cpu-bytes", "8GiB")
    assert p.returncode == 0, p.stderr
    extra = json.loads(p.stdout)["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 8 << 30
    # the tiers' options travel as written; each engine's tier reads them (tests/tiers/fs/test_fs_tier.py)
    assert [t["capacity_bytes"] for t in extra["secondary_tiers"]] == ["512MiB", "1e9"]


def test_vllm_config_refuses_an_ambiguous_size_in_one_line(tmp_path) -> None:
    p = run_raykv("vllm-config", "--cpu-bytes", "8G")
    assert p.returncode == 2
    assert "--cpu-bytes: size unit 'G' is ambiguous: write GiB or GB" in p.stderr
    cfg = tmp_path / "raykv.yaml"
    cfg.write_text("tiers:\n  - {type: object_store, capacity_bytes: 4G}\n")
    p = run_raykv("vllm-config", "--config", str(cfg))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert (
        p.stderr.strip()
        == "raykv: error: tiers[0].capacity_bytes: size unit 'G' is ambiguous: write GiB or GB; got '4G'"
    )


def test_vllm_config_warns_when_no_tier_is_listed(tmp_path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    no_tiers = tmp_path / "no-tiers.yaml"
    no_tiers.write_text("namespace: team-a\ntiers: []\n")
    for argv, namespace in ((), "raykv"), (("--config", str(empty)), "raykv"), (("--config", str(no_tiers)), "team-a"):
        p = run_raykv("vllm-config", *argv)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["kv_connector_extra_config"]["secondary_tiers"] == []  # still a usable config
        assert p.stderr.strip() == (
            f"raykv: warning: the raykv config (namespace {namespace!r}) lists no tiers: each engine gets only "
            "its own CPU primary, and no block is shared across replicas or outlives its engine. Add tiers, for "
            "example tiers: [{type: object_store}, {type: fs, root: /mnt/shared/raykv}]"
        )
    with_tier = tmp_path / "raykv.yaml"
    with_tier.write_text("tiers: [{type: object_store}]\n")
    p = run_raykv("vllm-config", "--config", str(with_tier))
    assert p.returncode == 0 and p.stderr == ""


def test_vllm_config_sets_the_identity_options() -> None:
    """``--model-revision`` / ``--weights-fingerprint``: what the Python API's
    ``raykv_kv_transfer_config`` takes, for engines started with ``vllm serve``."""
    p = run_raykv(
        "vllm-config",
        "--config",
        "cluster_configs/raykv.yaml",
        "--model-revision",
        "2026-12-04",
        "--weights-fingerprint",
        "none",
    )
    assert p.returncode == 0, p.stderr
    extra = json.loads(p.stdout)["kv_connector_extra_config"]
    assert extra["raykv_model_revision"] == "2026-12-04" and extra["raykv_weights_fingerprint"] == "none"
    p = run_raykv("vllm-config", "--model-revision", " ")
    assert p.returncode == 2 and p.stderr.strip().startswith("raykv: error: --model-revision: must be a non-empty")
    p = run_raykv("vllm-config", "--weights-fingerprint", "md5")
    assert p.returncode == 2 and "invalid choice: 'md5'" in p.stderr
