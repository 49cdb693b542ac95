"""What a cache hit saves on this machine: a model's prefill time per token against the
time to bring that token's KV from CPU memory into the engine's cache.

A hit replaces a prefill with a load. This measures both on the machine it runs on,
with the same model shapes, in the same run:

- **prefill**: a Llama-style layer stack with random weights (RMSNorm, q/k/v/o
  projections, causal attention with grouped KV heads, gated MLP) over one prompt,
  timed for ``--layers-run`` layers and scaled to the model's layer count, plus the
  LM head for the last token (engines compute logits only where they sample);
  RoPE is left out (elementwise, a small share);
- **load**: the prompt's KV bytes copied from CPU memory into a buffer on the
  engine's device, as one contiguous copy (the bandwidth floor) and as one copy per
  block per layer (``--block-size`` tokens, K and V together: the granularity of an
  engine's paged cache). Sources: raykv's primary region (a ``/dev/shm`` mapping,
  ``raykv.engine.primary.PrimaryRegion``), and on CUDA also that region registered
  with ``cudaHostRegister``, a ``pin_memory`` tensor, and pageable memory.

The ratio prefill / load (over the contiguous copy: vLLM's CUDA worker issues its block copies from C++,
``ops.swap_blocks``, not one Python call each) says how many times faster a hit is than computing, before
any directory or transfer overhead. ``bench`` is raykv's bench model (priced per KV
byte like Llama-3.1-8B); ``llama-3.1-8b`` is that model's shapes. It needs torch
only (no Ray), so it runs on any machine with an accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from raykv.bench.common import (
    at_least,
    bad_option,
    counts_option,
    entries,
    fill_defaults,
    fmt,
    machine,
    names_option,
    num,
    section,
    table,
    target,
    targets_table,
)
from raykv.core.wire import JsonValue, Report
from raykv.demo.tiny_model import (
    BENCH_CONFIG,
    LLAMA_3_1_8B_CONFIG,
    ModelConfig,
    dimension,
    kv_bytes_per_token,
    prefill_flop_per_kv_byte,
)
from raykv.engine.primary import PrimaryRegion

if TYPE_CHECKING:
    import torch

HELP = "what a hit saves here: a model's prefill time per token against loading its KV from CPU memory"

MODELS: dict[str, ModelConfig] = {"bench": BENCH_CONFIG, "llama-3.1-8b": LLAMA_3_1_8B_CONFIG}
DEVICES = ("auto", "cpu", "cuda")
FULL: dict[str, object] = {"models": "bench,llama-3.1-8b", "tokens": None, "layers_run": 2, "repeats": 5}
QUICK: dict[str, object] = {"models": "bench", "tokens": "128,512", "layers_run": 1, "repeats": 2}
#: Prompt lengths when --tokens is not given: a CPU prefills an 8B model's layers slowly.
TOKENS_CPU = "512,2048"
TOKENS_CUDA = "1024,4096,16384"
#: A hit is worth taking when its load costs at most a tenth of the prefill it saves.
MIN_PREFILL_OVER_LOAD = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        help=f"comma-separated, of {', '.join(MODELS)} (default {FULL['models']}; --quick: {QUICK['models']})",
    )
    p.add_argument(
        "--tokens",
        help=f"prompt lengths, comma-separated (default {TOKENS_CPU} on CPU, {TOKENS_CUDA} on CUDA; "
        f"--quick: {QUICK['tokens']})",
    )
    p.add_argument(
        "--layers-run",
        type=int,
        help="layers actually built and timed; the time is scaled to the model's layer count "
        f"(default {FULL['layers_run']}; --quick: {QUICK['layers_run']})",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per block of the engine's cache (default 16)")
    p.add_argument("--repeats", type=int, help=f"timed runs of each (median; default {FULL['repeats']})")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu or cuda")


def run(args: argparse.Namespace) -> Report:
    fill_defaults(args, FULL, QUICK)
    import torch

    models = names_option("--models", str(args.models), tuple(MODELS))
    device = _device(str(args.device))
    tokens = counts_option("--tokens", args.tokens or (TOKENS_CUDA if device == "cuda" else TOKENS_CPU))
    at_least(1, layers_run=args.layers_run, block_size=args.block_size, repeats=args.repeats)
    bad = [n for n in tokens if n % args.block_size]
    if bad:
        raise bad_option(f"--tokens: multiples of --block-size ({args.block_size}), got {bad}")
    torch.manual_seed(0)
    rows: list[Report] = []
    for name in models:
        config = MODELS[name]
        stack = LayerStack(config, min(args.layers_run, dimension(config, "num_hidden_layers")), device)
        for n in tokens:
            prefill_s = stack.prefill_seconds(n, args.repeats)
            loads = load_seconds(config, n, args.block_size, device, args.repeats)
            rows.append(
                {
                    "model": name,
                    "tokens": n,
                    "kv_bytes": n * kv_bytes_per_token(config),
                    "prefill_s": prefill_s,
                    "prefill_tflops": stack.flop(n) / prefill_s / 1e12,
                    "loads": {source: dataclasses.asdict(times) for source, times in loads.items()},
                    "prefill_over_load": prefill_s / min(v.contiguous_s for v in loads.values()),
                    "prefill_over_per_block_layer_load": prefill_s / min(v.per_block_layer_s for v in loads.values()),
                }
            )
        del stack  # its weights, before the next model's
    targets = [
        target(
            f"{r['model']}, {r['tokens']} tokens: prefill / load",
            num(r["prefill_over_load"]),
            MIN_PREFILL_OVER_LOAD,
            detail="one contiguous copy from the fastest source",
        )
        for r in rows
        if r["tokens"] == max(tokens)
    ]
    return {
        "bench": "recompute",
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers_run": args.layers_run,
        "block_size": args.block_size,
        "repeats": args.repeats,
        "flop_per_kv_byte": {name: prefill_flop_per_kv_byte(MODELS[name]) for name in models},
        "rows": list[JsonValue](rows),
        "targets": targets,
        "machine": machine(),
    }


def format_result(result: Report) -> str:
    rows = [section(r) for r in entries(result["rows"])]
    sources = sorted({s for r in rows for s in section(r["loads"])})
    headers = ["model", "tokens", "KV MiB", "prefill ms", "TFLOP/s"]
    headers += [f"load {s} ms" for s in sources] + ["prefill / load"]
    body = []
    for r in rows:
        cells: list[object] = [r["model"], r["tokens"], num(r["kv_bytes"]) / 2**20, num(r["prefill_s"]) * 1e3]
        cells.append(r["prefill_tflops"])
        for s in sources:
            load = section(section(r["loads"]).get(s))
            cells.append(
                f"{fmt(num(load.get('contiguous_s')) * 1e3, 3)} ({fmt(num(load.get('per_block_layer_s')) * 1e3, 3)})"
            )
        cells.append(f"{fmt(r['prefill_over_load'], 1)} ({fmt(r['prefill_over_per_block_layer_load'], 1)})")
        body.append(cells)
    title = (
        f"raykv bench recompute: {result['device_name']} (torch {result['torch']}), "
        f"{result['layers_run']} layers timed and scaled, {result['block_size']}-token blocks; "
        "load ms: one contiguous copy (one copy per block per layer, issued from Python)"
    )
    return table(headers, body, title=title) + "\n\n" + targets_table(result["targets"])


def _device(choice: str) -> str:
    import torch

    if choice not in DEVICES:
        raise bad_option(f"--device: one of {', '.join(DEVICES)}, got {choice!r}")
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise bad_option("--device: cuda, but torch sees no CUDA device here")
    return "cuda" if choice == "cuda" or (choice == "auto" and has_cuda) else "cpu"


class LayerStack:
    """``layers_run`` Llama-style layers of ``config`` with random bf16 weights on ``device``."""

    def __init__(self, config: ModelConfig, layers_run: int, device: str) -> None:
        import torch as t

        self.t = t
        self.device = device
        self.layers = dimension(config, "num_hidden_layers")
        self.layers_run = layers_run
        self.h = dimension(config, "hidden_size")
        self.heads = dimension(config, "num_attention_heads")
        self.kv_heads = dimension(config, "num_key_value_heads")
        self.d = dimension(config, "head_dim")
        self.inter = dimension(config, "intermediate_size")
        self.vocab = dimension(config, "vocab_size")

        def weight(rows: int, cols: int) -> "torch.Tensor":
            return t.randn(rows, cols, dtype=t.bfloat16, device=device) * (cols**-0.5)

        q, kv = self.heads * self.d, self.kv_heads * self.d
        self.weights = [
            (weight(q + 2 * kv, self.h), weight(self.h, q), weight(2 * self.inter, self.h), weight(self.h, self.inter))
            for _ in range(layers_run)
        ]
        self.lm_head = weight(self.vocab, self.h)

    def flop(self, tokens: int) -> float:
        """Matmul FLOPs of the whole model's prefill of ``tokens`` (attention scores included)."""
        q, kv = self.heads * self.d, self.kv_heads * self.d
        per_token = 2 * (self.h * (q + 2 * kv) + q * self.h + 3 * self.h * self.inter)
        attention = 2 * 2 * self.heads * self.d * tokens * (tokens + 1) / 2  # QK^T and PV, causal
        return self.layers * (per_token * tokens + attention) + 2 * self.h * self.vocab

    def _attention_kernels(self) -> "AbstractContextManager[None]":
        """On CUDA, flash or memory-efficient attention only (an error rather than the math path)."""
        if self.device != "cuda":
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])

    def _layers(self, x: "torch.Tensor") -> "torch.Tensor":
        f = self.t.nn.functional
        n = x.shape[0]
        q, kv = self.heads * self.d, self.kv_heads * self.d
        for w_qkv, w_o, w_up, w_down in self.weights:
            y = f.rms_norm(x, (self.h,))
            qkv = y @ w_qkv.T
            qs = qkv[:, :q].view(1, n, self.heads, self.d).transpose(1, 2)
            ks = qkv[:, q : q + kv].view(1, n, self.kv_heads, self.d).transpose(1, 2)
            vs = qkv[:, q + kv :].view(1, n, self.kv_heads, self.d).transpose(1, 2)
            # KV heads repeated rather than enable_gqa=True, and 4-D inputs: otherwise torch's
            # CUDA SDPA may take its O(n^2) math path, which a serving engine's kernels never do.
            group = self.heads // self.kv_heads
            ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            with self._attention_kernels():
                attn = f.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0]
            x = x + attn.transpose(0, 1).reshape(n, q) @ w_o.T
            gate_up = f.rms_norm(x, (self.h,)) @ w_up.T
            x = x + (f.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]) @ w_down.T
        return x

    def _head(self, x: "torch.Tensor") -> "torch.Tensor":
        return self.t.nn.functional.rms_norm(x[-1:], (self.h,)) @ self.lm_head.T

    def prefill_seconds(self, tokens: int, repeats: int) -> float:
        """Median seconds of one prefill of ``tokens`` tokens, scaled to all layers."""
        t = self.t
        x = t.randn(tokens, self.h, dtype=t.bfloat16, device=self.device)
        with t.inference_mode():
            self._head(self._layers(x))  # warm-up: kernels chosen, memory pooled
            layers_s = statistics.median(_timed(self.device, lambda: self._layers(x)) for _ in range(repeats))
            head_s = statistics.median(_timed(self.device, lambda: self._head(x)) for _ in range(max(repeats, 3)))
        # The layers not built cost what the timed ones did.
        return layers_s * self.layers / self.layers_run + head_s


@dataclasses.dataclass(frozen=True)
class LoadTimes:
    """Median seconds of one load from a source, and how it was cut."""

    contiguous_s: float
    per_block_layer_s: float
    piece_bytes: int
    copies: int


def load_seconds(config: ModelConfig, tokens: int, block_size: int, device: str, repeats: int) -> dict[str, LoadTimes]:
    """Per CPU source: median seconds to copy ``tokens`` tokens' KV into a buffer on ``device``,
    contiguously and as one copy per block per layer."""
    import torch as t

    nbytes = tokens * kv_bytes_per_token(config)
    layers = dimension(config, "num_hidden_layers")
    piece = block_size * kv_bytes_per_token(config) // layers
    dest = t.empty(nbytes, dtype=t.uint8, device=device)
    out: dict[str, LoadTimes] = {}
    pattern = t.arange(251, dtype=t.uint8).repeat(nbytes // 251 + 1)[:nbytes]
    for name, source in _sources(nbytes, device):
        source.copy_(pattern)

        def contiguous(src: "torch.Tensor" = source) -> None:
            dest.copy_(src, non_blocking=True)

        def per_piece(src: "torch.Tensor" = source) -> None:
            for start in range(0, nbytes, piece):
                dest[start : start + piece].copy_(src[start : start + piece], non_blocking=True)

        for copy in (contiguous, per_piece):
            dest.zero_()
            copy()
            if not t.equal(dest[::4093].cpu(), pattern[::4093]):
                raise RuntimeError(f"{name}: the bytes copied to {device} differ from the source's")
        out[name] = LoadTimes(
            contiguous_s=statistics.median(_timed(device, contiguous) for _ in range(repeats)),
            per_block_layer_s=statistics.median(_timed(device, per_piece) for _ in range(repeats)),
            piece_bytes=piece,
            copies=nbytes // piece,
        )
    return out


def _sources(nbytes: int, device: str) -> Iterator[tuple[str, "torch.Tensor"]]:
    import torch

    with PrimaryRegion(1, nbytes) as region:
        yield "shm", torch.from_numpy(region.array.reshape(-1))
        if device == "cuda":
            with _host_registered(region):
                yield "shm+registered", torch.from_numpy(region.array.reshape(-1))
    if device == "cuda":
        yield "pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        yield "pageable", torch.empty(nbytes, dtype=torch.uint8)


@contextmanager
def _host_registered(region: PrimaryRegion) -> Iterator[None]:
    """The region page-locked for DMA, as a CUDA engine's pinned CPU tier must be."""
    import torch

    cudart = torch.cuda.cudart()
    ptr = region.array.ctypes.data
    rc = cudart.cudaHostRegister(ptr, region.array.nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of the primary region failed: {rc}")
    try:
        yield
    finally:
        cudart.cudaHostUnregister(ptr)


def _timed(device: str, fn: Callable[[], object]) -> float:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
