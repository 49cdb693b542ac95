"""``raykv bench recompute``: a model's prefill against loading its KV, on CPU here and on CUDA where there is one."""

from __future__ import annotations

import argparse

import pytest
import torch

from raykv.bench import recompute
from raykv.demo.tiny_model import BENCH_CONFIG, LLAMA_3_1_8B_CONFIG, kv_bytes_per_token


def _args(**given: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    recompute.add_arguments(p)
    args = p.parse_args(["--quick"])
    for name, value in given.items():
        setattr(args, name, value)
    return args


def _check(result: dict, device: str, models: list[str], tokens: list[int], sources: set[str]) -> None:
    assert result["device"] == device
    rows = result["rows"]
    assert [(r["model"], r["tokens"]) for r in rows] == [(m, n) for m in models for n in tokens]
    for r in rows:
        config = recompute.MODELS[r["model"]]
        assert r["kv_bytes"] == r["tokens"] * kv_bytes_per_token(config)
        assert set(r["loads"]) == sources
        for load in r["loads"].values():
            assert load["contiguous_s"] > 0 and load["per_block_layer_s"] > 0
            assert load["copies"] * load["piece_bytes"] == r["kv_bytes"]
        assert r["prefill_s"] > 0 and r["prefill_tflops"] > 0
        assert r["prefill_over_load"] == pytest.approx(
            r["prefill_s"] / min(v["contiguous_s"] for v in r["loads"].values())
        )
        assert r["prefill_over_per_block_layer_load"] == pytest.approx(
            r["prefill_s"] / min(v["per_block_layer_s"] for v in r["loads"].values())
        )
    assert [t["target"] for t in result["targets"]] == [f"{m}, {tokens[-1]} tokens: prefill / load" for m in models]
    text = recompute.format_result(result)
    assert "prefill / load" in text and all(f"load {s} ms" in text for s in sources)


def test_measures_prefill_and_loads_from_the_primary_region_on_cpu() -> None:
    """Both models' shapes (one layer timed), each load checked byte for byte, from raykv's
    shared-memory primary region: the only CPU source."""
    result = recompute.run(_args(models="bench,llama-3.1-8b", tokens="32,64", device="cpu"))
    _check(result, "cpu", ["bench", "llama-3.1-8b"], [32, 64], {"shm"})
    # A block per layer of K and V together: 16 tokens' KV over the layer count.
    llama = [r for r in result["rows"] if r["model"] == "llama-3.1-8b"][0]
    assert llama["loads"]["shm"]["piece_bytes"] == 16 * kv_bytes_per_token(LLAMA_3_1_8B_CONFIG) // 32
    assert result["flop_per_kv_byte"]["bench"] == pytest.approx(112e3, rel=0.02)


def test_the_flop_count_is_the_models_matmuls_plus_causal_attention() -> None:
    stack = recompute.LayerStack(BENCH_CONFIG, layers_run=1, device="cpu")
    h, inter, heads, kv_heads, d = 1024, 8192, 8, 1, 128
    per_token = 2 * (h * (heads * d + 2 * kv_heads * d) + heads * d * h + 3 * h * inter)
    n = 64
    attention = 2 * 2 * heads * d * n * (n + 1) / 2
    assert (
        stack.flop(n)
        == BENCH_CONFIG["num_hidden_layers"] * (per_token * n + attention) + 2 * h * BENCH_CONFIG["vocab_size"]
    )


@pytest.mark.gpu
def test_loads_onto_cuda_from_the_registered_primary_region_pinned_and_pageable_memory() -> None:
    """On CUDA: raykv's primary region page-locked with cudaHostRegister (as a CUDA engine's
    CPU tier must be for DMA), a pin_memory tensor and pageable memory, each copy checked."""
    assert torch.cuda.is_available()
    result = recompute.run(_args(models="bench,llama-3.1-8b", tokens="64,256", device="cuda"))
    _check(result, "cuda", ["bench", "llama-3.1-8b"], [64, 256], {"shm", "shm+registered", "pinned", "pageable"})
    assert result["device_name"] == torch.cuda.get_device_name()


def test_the_command_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from raykv.ops.cli import main

    assert main(["bench", "recompute", "--quick", "--json", "--device", "cpu", "--tokens", "32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["tokens"]) for r in result["rows"]] == [("bench", 32)]
    assert result["targets"][0]["passed"] is True  # a CPU computes far slower than it copies
