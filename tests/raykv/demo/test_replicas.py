"""``raykv.demo.replicas``' checks before replicas start: the model directory, and
whether the replicas fit in memory (through the real command, where a user meets them)."""

from __future__ import annotations

import json

import pytest

from raykv.core.validate import ArgumentError
from raykv.demo import replicas
from raykv.demo.replicas import REPLICA_BASE_BYTES, available_memory_bytes, check_replicas_fit, model_config
from raykv.demo.tiny_model import build_tiny_model
from tests.cli_run import run_raykv


def test_model_config_reads_a_real_model() -> None:
    cfg = model_config(build_tiny_model())
    assert cfg["num_hidden_layers"] >= 1 and cfg["hidden_size"] >= 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: str(d / "missing"), "no such model directory"),
        (lambda d: (d / "f.txt").write_text("x") and str(d / "f.txt"), "is a file: give a model directory"),
        (lambda d: str(d), "has no config.json: not a Hugging Face model directory"),
        (lambda d: (d / "config.json").write_text("{") and str(d), "cannot read"),
        (lambda d: (d / "config.json").write_text("[1]") and str(d), "holds a list, not a JSON object"),
        (
            lambda d: (
                (d / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": True})) and str(d)
            ),
            "gives no integer num_hidden_layers, num_attention_heads",
        ),
    ],
)
def test_model_config_names_the_option_and_the_problem(tmp_path, make, message) -> None:
    with pytest.raises(ArgumentError, match=message) as e:
        model_config(make(tmp_path))
    assert e.value.field == "--model"


def test_replicas_that_cannot_fit_are_refused_with_the_most_that_fit(tmp_path, monkeypatch) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    monkeypatch.setattr(replicas, "available_memory_bytes", lambda: 10 * REPLICA_BASE_BYTES)
    check_replicas_fit(9, str(model))  # 9 x (1 GiB + 1 MiB) fit in 10 GiB
    with pytest.raises(ArgumentError, match=r"enough for at most 9$") as e:
        check_replicas_fit(10, str(model))
    assert e.value.field == "--replicas"
    monkeypatch.setattr(replicas, "available_memory_bytes", lambda: None)
    check_replicas_fit(10**6, str(model))  # unknown memory: no guess


def test_available_memory_is_read_on_linux() -> None:
    available = available_memory_bytes()
    assert available is not None and 0 < available


def test_the_commands_refuse_a_bad_model_or_too_many_replicas_before_starting_ray(tmp_path) -> None:
    for argv in (("demo",), ("bench", "e2e"), ("bench", "fork")):
        p = run_raykv(*argv, "--model", str(tmp_path))
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().startswith(f"raykv: error: --model: {str(tmp_path)!r} has no config.json"), p.stderr
        p = run_raykv(*argv, "--replicas", "100000", "--tiny")
        assert p.returncode == 2, p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("raykv: error: --replicas: 100000 replicas need about") and "at most" in last, last
        assert p.stderr.strip() == last  # one line: no Ray started, no traceback


def test_the_demo_and_bench_e2e_refuse_one_replica() -> None:
    """Their probes load a prefix on a replica that did not compute it; with one
    replica they would read the engine's own cache and report it as raykv's."""
    for argv, words in (
        (("demo",), "raykv demo: error: argument --replicas: must be an integer >= 2, got '1'"),
        (("bench", "e2e"), "raykv: error: --replicas: at least 2 (promoted requests and the probe load"),
    ):
        p = run_raykv(*argv, "--replicas", "1", "--tiny")
        assert p.returncode == 2, p.stderr
        assert words in p.stderr.strip().splitlines()[-1], p.stderr
