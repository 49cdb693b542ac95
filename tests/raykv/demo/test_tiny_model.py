"""The tiny model builds deterministically and loads with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.demo.tiny_model import (
    BENCH_CONFIG,
    BENCH_MODEL_NAME,
    CONFIG,
    LLAMA_3_1_8B_CONFIG,
    MODEL_NAME,
    VOCAB_SIZE,
    build_bench_model,
    build_tiny_model,
    kv_bytes_per_token,
    make_prompt_tokens,
    model_fingerprint,
    prefill_flop_per_kv_byte,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


def test_loads_with_transformers(tiny: str) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)

    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == VOCAB_SIZE
    text = "The cache keeps recently used data close."
    ids = tok(text)["input_ids"]
    assert 0 < len(ids) < len(text)  # BPE merged something
    assert tok.decode(ids) == text
    assert tok.eos_token_id == CONFIG["eos_token_id"]

    with safe_open(str(Path(tiny) / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        k_proj = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
    assert str(embed.dtype) == "torch.bfloat16"
    assert tuple(embed.shape) == (VOCAB_SIZE, 256)
    assert tuple(k_proj.shape) == (2 * 64, 256)


def test_build_is_deterministic_and_cached(tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_CACHE_DIR", str(tmp_path))
    again = build_tiny_model()  # default path honours RAYKV_CACHE_DIR
    assert again == str(tmp_path / MODEL_NAME)
    assert model_fingerprint(again) == model_fingerprint(tiny)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    mtime = (Path(again) / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model() == again  # second call reuses the build
    assert (Path(again) / "model.safetensors").stat().st_mtime_ns == mtime
    assert json.loads((Path(again) / "config.json").read_text()) == CONFIG


def test_make_prompt_tokens() -> None:
    a = make_prompt_tokens(1000, seed=1)
    assert len(a) == 1000 and a == make_prompt_tokens(1000, seed=1)
    assert all(3 <= t < VOCAB_SIZE for t in a)  # no special tokens
    b = make_prompt_tokens(1000, seed=2)
    assert a[0] != b[0]  # no shared prefix between seeds
    assert make_prompt_tokens(0) == []


def test_bench_model_prices_prefill_like_a_real_model(tmp_path: Path) -> None:
    """Prefill FLOPs per KV byte within 4x of Llama-3.1-8B's (the tiny model is ~34x off)."""
    llama = prefill_flop_per_kv_byte(LLAMA_3_1_8B_CONFIG)
    assert llama == pytest.approx(16e9 / (128 << 10), rel=0.1)  # ~16 GFLOP per token over 128 KiB of KV
    bench = prefill_flop_per_kv_byte(BENCH_CONFIG)
    assert llama / 4 <= bench <= llama * 4
    assert llama / prefill_flop_per_kv_byte(CONFIG) > 30

    from safetensors import safe_open
    from transformers import AutoConfig

    path = build_bench_model(tmp_path / BENCH_MODEL_NAME)
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads) == (1024, 8192, 1)
    assert kv_bytes_per_token(BENCH_CONFIG) == 1024
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape) == (128, 1024)
    # same tokenizer as the tiny model: traces and block hashes carry over
    assert (Path(path) / "tokenizer.json").read_bytes() == (
        Path(build_tiny_model(tmp_path / "t")) / "tokenizer.json"
    ).read_bytes()
