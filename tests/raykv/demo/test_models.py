"""``--model`` / ``--tiny`` / ``--quick``: the same built-in names and checks in the demo and every bench."""

from __future__ import annotations

import argparse

import pytest

from raykv.demo import models
from raykv.demo.tiny_model import BENCH_MODEL_NAME, MODEL_NAME
from raykv.ops.cli import build_parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_built_in_names_and_directories() -> None:
    path, name = models.resolve_model(_args("bench", "routing"))
    assert name == "bench" and path.endswith(BENCH_MODEL_NAME)
    assert models.full_name(path, name) == BENCH_MODEL_NAME
    for argv in (["--tiny"], ["--model", "tiny"], ["--quick"]):
        path, name = models.resolve_model(_args("bench", "routing", *argv))
        assert name == "tiny" and path.endswith(MODEL_NAME), argv
    model_dir = path  # a model directory goes through as it is, once its config.json is read
    assert models.resolve_model(_args("bench", "routing", "--model", model_dir)) == (model_dir, model_dir)
    assert models.full_name(model_dir, model_dir) == model_dir
    with pytest.raises(ValueError, match=r"--model: no such model directory '/models/x' \(or one of bench, "):
        models.resolve_model(_args("bench", "routing", "--model", "/models/x"))
    with pytest.raises(ValueError, match="--tiny and --model bench: pick one"):
        models.resolve_model(_args("bench", "routing", "--tiny", "--model", "bench"))


def test_the_demo_and_bench_e2e_take_the_same_names_and_their_quick_keeps_the_bench_model() -> None:
    for command in (["demo"], ["bench", "e2e"]):
        assert models.model_name(_args(*command)) == "bench"
        for argv in (["--tiny"], ["--model", "tiny"]):
            path, name = models.resolve_model(_args(*command, *argv), quick_means_tiny=False)
            assert name == "tiny" and path.endswith(MODEL_NAME), (command, argv)
        assert models.model_name(_args(*command, "--model", "bench-long"), quick_means_tiny=False) == "bench-long"
    assert models.model_name(_args("bench", "e2e", "--quick"), quick_means_tiny=False) == "bench"


def test_model_positions_are_read_without_building() -> None:
    assert models.model_positions(_args("bench", "fork", "--model", "bench-long")) == 32768
    assert models.model_positions(_args("bench", "fork")) < 32768


def _refused(capsys, option: str, bad: str, allowed: str) -> None:
    """``raykv demo <option> <bad>`` exits 2 with argparse's message naming what is allowed."""
    with pytest.raises(SystemExit) as e:
        _args("demo", option, bad)
    assert e.value.code == 2
    assert f"{option}: must be {allowed}, got {bad!r}" in capsys.readouterr().err


def test_demo_concurrency_takes_zero_and_refuses_negatives(capsys) -> None:
    assert _args("demo", "--concurrency", "0").concurrency == 0
    for bad in ("-1", "two"):
        _refused(capsys, "--concurrency", bad, "0 or a positive integer")


def test_the_demo_needs_two_replicas(capsys) -> None:
    """One replica has nobody to share blocks with: its probe would compare the engine's own
    cache with itself and pass whatever raykv did. Refused by the parser and by ``demo()``."""
    from raykv.core.validate import ArgumentError
    from raykv.demo.run import demo

    assert _args("demo", "--replicas", "2").replicas == 2
    for bad in ("1", "0"):
        _refused(capsys, "--replicas", bad, "an integer >= 2")
    with pytest.raises(ArgumentError, match="replicas: must be an integer >= 2"):
        demo(replicas=1, show_progress=False)
