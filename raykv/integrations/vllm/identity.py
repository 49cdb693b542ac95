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
  layout), so engines whose chunks differ in any way never meet;
- ``engine_config``: what of the engine's own vLLM config changes its KV bytes
  for the same weights (``engine_config_fields``): the compute dtype (the spec
  names only the KV cache's, which an fp8 cache hides), on-the-fly
  quantization, the model's config after ``hf_overrides`` (RoPE settings live
  there), the model implementation, fp8 scale calculation and the requested
  hub revision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import uuid
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

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
    engine_config: Any = None,
) -> KVIdentity:
    """The ``KVIdentity`` of the engine that built ``spec`` (vLLM's ``OffloadingSpec``).
    ``engine_config`` is the engine's ``VllmConfig`` (``find_engine_config``); without it
    the identity says so (``engine_config: unknown``) and meets only others that lack it.
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
    layout["engine_config"] = engine_config_fields(engine_config) if engine_config is not None else "unknown"
    model = str(config.model.name)
    requested = getattr(getattr(engine_config, "model_config", None), "revision", None)
    revision = model_revision or hub_revision(model, requested) or ""
    weights = fingerprint_weights(model, weights_fingerprint)
    return KVIdentity(model=model, revision=revision, weights=weights, layout=layout)


def engine_config_fields(vllm_config: Any) -> dict[str, JsonValue]:
    """The settings of an engine's ``VllmConfig`` that change its KV bytes for the same
    weights, KV dtype and layout (``None`` where this vLLM has no such field)."""
    model = vllm_config.model_config
    cache = getattr(vllm_config, "cache_config", None)
    quantization = getattr(model, "quantization", None)
    hf_config = getattr(model, "hf_config", None)
    return {
        "model_dtype": str(getattr(model, "dtype", None)),
        "quantization": None if quantization is None else str(quantization),
        "model_impl": _plain(getattr(model, "model_impl", None)),
        "revision": _plain(getattr(model, "revision", None)),
        "calculate_kv_scales": bool(getattr(cache, "calculate_kv_scales", False)),
        "hf_config": _config_digest(hf_config),
    }


def _plain(value: object) -> str | None:
    """An enum's value, or any other setting as text (None stays None)."""
    if value is None:
        return None
    return str(getattr(value, "value", value))


def _config_digest(hf_config: object) -> str | None:
    """sha256 of a Hugging Face config's fields (after vLLM applied ``hf_overrides``)."""
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        return None
    try:
        text = json.dumps(to_dict(), sort_keys=True, separators=(",", ":"), default=str)
    except Exception as e:  # where unsure, miss: this engine then shares with no other
        logger.warning("raykv: cannot read the model's config (%r): this engine shares no KV block", e)
        return f"unreadable:{uuid.uuid4().hex}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def find_engine_config() -> Any:
    """The ``VllmConfig`` of the engine whose offloading connector is being built, or None.

    vLLM (0.29 to 0.34 checked) hands a spec and its tiers only the offloading
    config, which names the KV cache dtype but not the model's compute dtype,
    quantization or ``hf_overrides``; it offers no public accessor for the
    engine's config there, and ``get_current_vllm_config`` is not set in the
    scheduler process. ``OffloadingConnector.__init__`` holds it as its
    ``vllm_config`` argument, and builds the spec and the tiers under that call,
    so it is read from the calling frames."""
    from vllm.config import VllmConfig

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("vllm_config")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def hub_revision(model: str, revision: str | None = None) -> str | None:
    """The commit of the Hugging Face cache snapshot ``model`` (a hub id) resolves to at
    ``revision`` (a branch, tag or commit; the default branch when None), if cached."""
    if os.path.exists(model):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(model, "config.json", revision=revision)
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
