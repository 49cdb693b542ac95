"""The router's block hashes are vLLM's own (``raykv.integrations.vllm.hashing``)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("n", [0, 127, 128, 300])
def test_block_hashes_are_vllms(n: int) -> None:
    pytest.importorskip("vllm")
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    from raykv.integrations.vllm.hashing import block_hashes

    tokens = list(range(1000, 1000 + n))
    got = block_hashes(tokens, 128)
    assert len(got) == n // 128  # full blocks only
    parent = None
    for i, h in enumerate(got):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i * 128 : (i + 1) * 128], None)
        assert h == bytes(parent)
    # a salt changes every block (it is in the first, and the chain carries it); that the
    # salted keys are the engine's is checked on a real engine (test_kv_events.py)
    salted = block_hashes(tokens, 128, cache_salt="t1")
    assert not set(salted) & set(got)
