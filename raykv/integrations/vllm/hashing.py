"""vLLM's block hashes of a prompt, outside an engine (the router's and the benches' keys).

They must equal the engine's own, so they come from vLLM's functions: its hash
function by name, ``hash_block_tokens`` for the chain, and
``generate_block_hash_extra_keys`` for the first block's extra keys (the
request's ``cache_salt``; its format changed between 0.29, a bare string, and
0.32, ``("cache_salt", salt)``). That last one takes a ``Request``; the router
has only tokens and a salt, so it is handed a stand-in with the attributes the
function reads (checked on vLLM 0.29 and 0.32: ``mm_features``,
``lora_request``, ``cache_salt``, ``prompt_embeds``). vLLM exposes no public
API for hashing a prompt without a ``Request``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from vllm.v1.request import Request

_setup_lock = threading.Lock()
_hash_fns: dict[str, Callable[[object], bytes]] = {}


def _hash_fn(algo: str) -> Callable[[object], bytes]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    with _setup_lock:
        fn = _hash_fns.get(algo)
        if fn is None or getattr(kv_cache_utils, "NONE_HASH", None) is None:
            fn = get_hash_fn_by_name(algo)
            kv_cache_utils.init_none_hash(fn)
            _hash_fns.clear()
            _hash_fns[algo] = fn
        return fn


def _salt_extra_keys(cache_salt: str, block_tokens: int) -> tuple[object, ...] | None:
    """The extra keys vLLM hashes into a salted request's first block."""
    from vllm.v1.core import kv_cache_utils

    stand_in = SimpleNamespace(mm_features=[], lora_request=None, cache_salt=cache_salt, prompt_embeds=None)
    extra, _ = kv_cache_utils.generate_block_hash_extra_keys(cast("Request", stand_in), 0, block_tokens, 0)
    return extra


def block_hashes(
    tokens: Sequence[int],
    tokens_per_hash: int,
    cache_salt: str | None = None,
    algo: str = "sha256",
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """vLLM's hashes of the full blocks of ``tokens`` (its own functions, so they match the engine's).

    ``start`` (a multiple of ``tokens_per_hash``) and ``parent`` (the hash of the
    block before ``start``) continue a chain already hashed up to ``start``: the
    result is then the hashes of the blocks from ``start`` on."""
    from vllm.v1.core import kv_cache_utils

    if start % tokens_per_hash or (start > 0) != (parent is not None):
        raise ValueError(f"start {start} must be a multiple of {tokens_per_hash}, with a parent hash exactly when > 0")
    hash_fn = _hash_fn(algo)
    out: list[bytes] = []
    chain = parent
    for first in range(start, len(tokens) - tokens_per_hash + 1, tokens_per_hash):
        extra = _salt_extra_keys(cache_salt, tokens_per_hash) if first == 0 and cache_salt else None
        chain = kv_cache_utils.hash_block_tokens(hash_fn, chain, tokens[first : first + tokens_per_hash], extra)  # type: ignore[arg-type]  # vLLM's BlockHash is a NewType of bytes
        out.append(bytes(chain))
    return out


def prepare_hashing(algo: str = "sha256") -> None:
    """Import vLLM's hashing and set it up for ``algo`` (seconds on first use: do it off
    any event loop), so that ``block_hashes`` itself only hashes."""
    block_hashes([], 1, None, algo)
