"""An engine's KV identity, derived from vLLM's offloading spec.

The same fields vLLM's fs tier hashes into its folder names (model name,
dtype, tokens per hash, blocks per chunk, KV cache groups, tp/pp/pcp/dcp sizes,
rank, replicated layout, canonical format; ``vllm/v1/kv_offload/file_mapper.py``),
plus what vLLM's block hashes and folder names both leave out:

- ``revision``: the operator's ``model_revision`` (bump it on a weight update),
  else the Hugging Face cache snapshot (commit) the model was loaded from;
- ``weights``: a fingerprint of the weight files (``weights_fingerprint``):
  ``stat`` (default: names, sizes and modification times of the weight and
  config files: any rewrite changes it; copies on two nodes with different
  mtimes do not share, so such clusters set ``model_revision`` with ``none``,
  or use ``content``), ``content`` (a hash of every weight byte, cached per
  file size and mtime; exact, costs one read of the weights per new file), or
  ``none`` (trust the model name and revision, as vLLM's fs tier does);
- the primary's chunk size in bytes and vLLM's minor version (the KV page
  layout), so engines whose chunks differ in any way never meet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from raykv.core.identity import KVIdentity
from raykv.core.wire import JsonValue
from raykv.integrations.vllm.config import FINGERPRINT_MODES

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)


#: Files whose bytes decide the model's KV (weights, adapters, configs).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".tiktoken")
_CACHE_FILE = Path(os.environ.get("RAYKV_CACHE_DIR", Path.home() / ".cache" / "raykv")) / "weights_fingerprints.json"
_cache_lock = threading.Lock()


def engine_identity(
    spec: OffloadingSpec,
    chunk_bytes: int,
    model_revision: object = None,
    weights_fingerprint: object = "stat",
) -> KVIdentity:
    """The ``KVIdentity`` of the engine that built ``spec`` (vLLM's ``OffloadingSpec``).
    ``model_revision`` and ``weights_fingerprint`` are checked here (they come from tier configs)."""
    if not isinstance(weights_fingerprint, str) or weights_fingerprint not in FINGERPRINT_MODES:
        raise ValueError(
            f"weights_fingerprint: must be one of {', '.join(FINGERPRINT_MODES)}; got {weights_fingerprint!r}"
        )
    if model_revision is not None and (not isinstance(model_revision, str) or not model_revision):
        raise ValueError(f"model_revision: must be a non-empty str, got {model_revision!r}")
    import vllm

    config = spec.config
    parallel = config.parallel
    layout: dict[str, JsonValue] = {
        "engine": "vllm-" + ".".join(str(vllm.__version__).split(".")[:2]),
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "chunk_bytes": int(chunk_bytes),
        "kv_cache_groups": [
            {"tokens_per_block": int(g.tokens_per_block), "layer_names": list(g.layer_names)} for g in config.groups
        ],
        "tp": int(parallel.tp_size),
        "pp": int(parallel.pp_size),
        "pcp": int(parallel.pcp_size),
        "dcp": int(parallel.dcp_size),
        "world_size": int(parallel.world_size),
        "rank": int(parallel.rank),
        "replicated_layout": bool(getattr(config, "replicated_layout", False)),
    }
    if getattr(config, "canonical_layout", False):
        layout["canonical_format"] = str(getattr(config, "kv_cache_layout", None))
    model = str(config.model.name)
    revision = model_revision or hub_revision(model) or ""
    weights = fingerprint_weights(model, weights_fingerprint)
    return KVIdentity(model=model, revision=revision, weights=weights, layout=layout)


def hub_revision(model: str) -> str | None:
    """The commit of the Hugging Face cache snapshot ``model`` (a hub id) resolves to, if cached."""
    if os.path.exists(model):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(model, "config.json")
    except Exception:
        return None
    if isinstance(path, str) and "/snapshots/" in path:
        return "hf:" + path.split("/snapshots/", 1)[1].split("/", 1)[0]
    return None


def weight_files(model: str) -> list[Path]:
    """The files under a local model path whose bytes decide its KV."""
    root = Path(model)
    if root.is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def fingerprint_weights(model: str, mode: str = "stat") -> str:
    """A fingerprint of ``model``'s local weight files (``""`` for ``none``
    or when the model is not a local path)."""
    if mode == "none":
        return ""
    files = weight_files(model)
    if not files:
        return ""
    root = Path(model)
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        rel = str(f.relative_to(root)) if root.is_dir() else f.name
        part = [rel, st.st_size, st.st_mtime_ns] if mode == "stat" else [rel, st.st_size, _content_digest(f, st)]
        h.update(json.dumps(part).encode())
    return f"{mode}:{h.hexdigest()[:32]}"


def _content_digest(path: Path, st: os.stat_result) -> str:
    """blake2b of a file's bytes, cached by (path, size, mtime) across processes."""
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    with _cache_lock:
        cache = _read_cache()
        if key in cache:
            return cache[key]
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    with _cache_lock:
        cache = _read_cache()
        cache[key] = digest
        _write_cache(cache)
    return digest


def _read_cache() -> dict[str, str]:
    try:
        return json.loads(_CACHE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict[str, str]) -> None:
    try:
        _CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE_FILE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, _CACHE_FILE)
    except OSError as e:  # a cache only: the next start hashes again
        logger.debug("cannot write %s: %r", _CACHE_FILE, e)
