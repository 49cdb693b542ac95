"""Small, deterministic Llama models for demos, tests and benchmarks (no downloads).

`build_tiny_model()` writes a HF-format model directory (config, bf16 safetensors,
byte-level BPE tokenizer) that `vllm.LLM(model=path)` and `transformers` load.
Everything is derived from fixed seeds and an embedded corpus, so every node of a
cluster builds byte-identical files: equal token ids and weights, hence equal KV
block hashes and equal KV everywhere.

Three models share the tokenizer:

- the *tiny* model (hidden 256, 2 layers): fast to load and run, for tests that
  check behaviour, not speed;
- the *bench* model (`build_bench_model()`: hidden 1024, MLP 8192, 2 layers,
  GQA with 8 query heads over one KV head of 128): its prefill costs what a
  real model's does per byte of KV it leaves (`prefill_flop_per_kv_byte`: 112k
  FLOP/byte against 114k for Llama-3.1-8B; the tiny model is 34x off). A cache
  saves prefill, so benchmarks and the demo measure with it. A 1k-token
  prefill takes ~120 ms on a 2-core host with AMX (an earlier hidden-768 /
  MLP-3072 candidate, 36k FLOP/byte, took 42 ms there: too cheap);
- the *bench-long* model (`build_bench_long_model()`): the bench model's
  weights with 32768 positions instead of 4096, for prompts as long as agents'
  system prompts (the prompt-caching bench's 20k-token prefix). Its config
  differs, so raykv keys its blocks apart from the bench model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from raykv.core.wire import JsonValue

MODEL_NAME = "tiny-llama-v1"
BENCH_MODEL_NAME = "bench-llama-60m-v1"
BENCH_LONG_MODEL_NAME = "bench-llama-60m-32k-v1"
SEED = 1234
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2

#: A HF ``config.json`` (what the model directory holds).
ModelConfig = dict[str, JsonValue]

CONFIG: ModelConfig = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "torch_dtype": "bfloat16",
}

#: The bench model: a wide MLP and one KV head make prefill cost per KV byte
#: realistic (see `prefill_flop_per_kv_byte`); 59M parameters, built in ~3 s.
BENCH_CONFIG: ModelConfig = {
    **CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 8192,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 128,
}

#: The bench model with room for 32k-token prompts (same shapes and weights).
BENCH_LONG_CONFIG: ModelConfig = {**BENCH_CONFIG, "max_position_embeddings": 32768}

#: Llama-3.1-8B's shapes: the yardstick for `prefill_flop_per_kv_byte`.
LLAMA_3_1_8B_CONFIG: ModelConfig = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}


def dimension(config: ModelConfig, name: str) -> int:
    """An integer field of a model config (a size or a count)."""
    value = config[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"model config {name}: {value!r} is not an integer")
    return value


def kv_bytes_per_token(config: ModelConfig) -> int:
    """K and V of every layer for one token: 2 x layers x KV heads x head dim x dtype bytes."""
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[str(config.get("torch_dtype", "bfloat16"))]
    layers, kv_heads = dimension(config, "num_hidden_layers"), dimension(config, "num_key_value_heads")
    return 2 * layers * kv_heads * dimension(config, "head_dim") * dtype_bytes


def prefill_flop_per_kv_byte(config: ModelConfig) -> float:
    """Prefill FLOPs per token over KV bytes per token.

    FLOPs per token are 2 x the weights each token multiplies by: per layer the
    q, k, v and o projections and the gated MLP (gate, up, down), plus the LM
    head. Attention's own FLOPs grow with the context and are left out (they
    favour the larger model). Llama-3.1-8B: 2 x 7.5G = 15 GFLOP over 128 KiB =
    114k FLOP/byte; the bench model: 2 x 57M = 114 MFLOP over 1 KiB = 112k.
    """
    c = {name: dimension(config, name) for name in _DIMENSIONS}
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * c["intermediate_size"]
    weights = c["num_hidden_layers"] * per_layer + h * c["vocab_size"]
    return 2 * weights / kv_bytes_per_token(config)


_WORDS = (
    "the a an of to in on for with from by at as is are was were be been has have "
    "had do does did not no yes and or but if then else when while where which who "
    "what why how all any some many few more most less each every other same new old "
    "first last next long short high low big small fast slow early late good bad "
    "cache block key value tier node cluster engine request token prompt model layer "
    "head memory disk storage object store load save copy move read write hit miss "
    "evict keep share send receive batch step queue job result error retry time "
    "data byte page chunk prefix hash table index map list set graph tree path file "
    "system process thread worker actor service server client user tenant policy "
    "river mountain forest city street house window garden table letter music story "
    "people water light night morning summer winter stone bridge market village road "
    "run walk open close start stop begin end give take make find see look build "
    "grow turn carry hold bring follow learn teach write speak listen answer ask"
).split()

_PARAGRAPHS = (
    "A cache keeps recently used data close to the place where it is needed. "
    "When the data is found in the cache we call it a hit; otherwise it is a miss "
    "and the data must be computed again or read from a slower tier.",
    "Large language models turn a prompt into tokens, and every token leaves keys "
    "and values in each attention layer. Reusing those keys and values for a shared "
    "prefix saves the time of computing them again.",
    "The river ran past the old mill, under the stone bridge, and out toward the sea. "
    "In the morning the market opened and people carried bread, fruit and fish "
    "along the narrow streets of the village.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096; punctuation: , . ; : ! ? "
    "( ) [ ] { } - _ = + * / \\ # @ $ % & ' \" < > | ~ `.",
    "def lookup(key):\n    if key in table:\n        return table[key]\n    return None\n",
)


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + [
    "th",
    "sh",
    "ch",
    "ng",
    "er",
    "an",
    "in",
    "on",
    "st",
    "tr",
    "qu",
    "x",
    "y",
]


def _corpus(seed: int = SEED, n_sentences: int = 6000) -> list[str]:
    """Embedded paragraphs plus seeded pseudo-sentences (deterministic everywhere).

    Pseudo-words built from syllables give BPE enough distinct pairs to fill the
    whole vocab with merges (real words alone saturate long before 2048).
    """
    rng = np.random.default_rng(seed)
    lines = list(_PARAGRAPHS) * 20
    for _ in range(n_sentences):
        words = []
        for _ in range(int(rng.integers(4, 16))):
            if rng.random() < 0.6:
                words.append(_WORDS[int(rng.integers(len(_WORDS)))])
            else:
                n_syl = int(rng.integers(1, 4))
                idx = rng.integers(0, len(_SYLLABLES), n_syl)
                words.append("".join(_SYLLABLES[i] for i in idx))
        lines.append(" ".join(words).capitalize() + ".")
    return lines


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Pad the vocab to exactly VOCAB_SIZE so the embedding shape is fixed.
    have = tok.get_vocab_size()
    if have < VOCAB_SIZE:
        tok.add_tokens([f"<extra_{i}>" for i in range(VOCAB_SIZE - have)])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": CONFIG["max_position_embeddings"],
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


#: The config fields that give a Llama model's shapes.
_DIMENSIONS = (
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
)


def _weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = {name: dimension(config, name) for name in _DIMENSIONS}
    h, inter, v, d = (
        c["hidden_size"],
        c["intermediate_size"],
        c["vocab_size"],
        c["head_dim"],
    )
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def _build_weights(out: Path, config: ModelConfig, seed: int = SEED) -> None:
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)  # PCG64: same stream on every platform
    tensors = {}
    for name, shape in sorted(_weight_shapes(config).items()):
        if name.endswith("norm.weight"):
            arr = np.ones(shape, dtype=np.float32)
        else:
            # Embeddings get std 1 so hidden states are not all ~0 before the
            # first RMSNorm; projections use the usual 0.02.
            std = 1.0 if "embed_tokens" in name else 0.02
            arr = rng.normal(0.0, std, size=shape).astype(np.float32)
        tensors[name] = torch.from_numpy(arr).to(torch.bfloat16).contiguous()
    tmp = out / f".model.{os.getpid()}.safetensors"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")


def reseed_weights(path: str | os.PathLike, seed: int) -> None:
    """Rewrite a built model's weights from ``seed``: same shapes, other
    values (a fine-tune, or a weight update in place)."""
    config = json.loads((Path(path) / "config.json").read_text())
    _build_weights(Path(path), config, seed)


def default_cache_dir() -> Path:
    """`$RAYKV_CACHE_DIR` or `~/.cache/raykv`."""
    env = os.environ.get("RAYKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "raykv"


def _build_model(config: ModelConfig, name: str, path: str | os.PathLike | None) -> str:
    """Build a model directory once (atomically) and return its path.

    `path` defaults to `<cache dir>/<name>`. An existing complete build is
    reused; concurrent builders race harmlessly (the first rename wins).
    """
    target = Path(path) if path is not None else default_cache_dir() / name
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build_tokenizer(tmp)
        _build_weights(tmp, config)
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}))
        # config.json last: its presence marks a complete build.
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise  # not a lost race: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_tiny_model(path: str | os.PathLike | None = None) -> str:
    """The tiny model (`<cache dir>/tiny-llama-v1` by default): for tests that check behaviour."""
    return _build_model(CONFIG, MODEL_NAME, path)


def build_bench_model(path: str | os.PathLike | None = None) -> str:
    """The bench model (`<cache dir>/bench-llama-60m-v1` by default): prefill priced like a real model's."""
    return _build_model(BENCH_CONFIG, BENCH_MODEL_NAME, path)


def build_bench_long_model(path: str | os.PathLike | None = None) -> str:
    """The bench model with 32768 positions (`<cache dir>/bench-llama-60m-32k-v1` by default)."""
    return _build_model(BENCH_LONG_CONFIG, BENCH_LONG_MODEL_NAME, path)


def model_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over the model's files (to check that nodes built the same model)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def make_prompt_tokens(n_tokens: int, seed: int = 0) -> list[int]:
    """`n_tokens` deterministic token ids (no special tokens) for a long prompt.

    Feed them to vLLM as `{"prompt_token_ids": ids}`; different seeds give
    prompts with no common prefix (their first tokens differ).
    """
    rng = np.random.default_rng([SEED, seed])
    first = len(SPECIAL_TOKENS)
    ids = rng.integers(first, VOCAB_SIZE, n_tokens)
    if n_tokens:
        # Distinct first token per seed, so prompts never share a prefix block.
        ids[0] = first + seed % (VOCAB_SIZE - first)
    return [int(i) for i in ids]
