"""The router's prompt key cache: reused token ids and hashes equal a whole-text encode's."""

from __future__ import annotations

import random

import pytest

from raykv.bench.common import decode
from raykv.demo.tiny_model import build_tiny_model, make_prompt_tokens
from raykv.integrations.vllm.hashing import block_hashes
from raykv.serve.prompt_keys import ANCHOR_CHARS, PromptKeyCache
from raykv.serve.prompts import PromptTokenizer

BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    prompts = PromptTokenizer(build_tiny_model())
    prompts.load()
    assert prompts._tokenizer is not None
    return prompts


def _text(tokenizer: PromptTokenizer, n_tokens: int, seed: int) -> str:
    assert tokenizer._tokenizer is not None
    return decode(tokenizer._tokenizer, make_prompt_tokens(n_tokens, seed))


def _chat_turns(tokenizer: PromptTokenizer, sessions: int, turns: int) -> list[str]:
    """Multi-turn prompts: each turn is the last one plus a message (what routing sees)."""
    rng = random.Random(3)
    system = _text(tokenizer, 400, 1)
    out = []
    for s in range(sessions):
        prompt = system + "\n" + _text(tokenizer, 100 + rng.randrange(100), 100 + s)
        out.append(prompt)
        for t in range(1, turns):
            prompt = prompt + "\n" + _text(tokenizer, 50 + rng.randrange(200), 1000 * s + t)
            out.append(prompt)
    return out


def test_reused_tokens_and_hashes_equal_a_whole_encode(tokenizer: PromptTokenizer) -> None:
    assert tokenizer._tokenizer is not None
    prompts = _chat_turns(tokenizer, sessions=4, turns=4)
    for salt in (None, "tenant-a"):
        for prompt in prompts + prompts[:3]:  # repeats: whole-prompt hits
            keys = tokenizer.tokens(prompt)
            assert keys is not None
            whole = list(tokenizer._tokenizer.encode(prompt))
            assert list(keys.tokens) == whole
            assert tokenizer.block_hashes(keys, BLOCK, salt, "sha256") == block_hashes(whole, BLOCK, salt)
    cache = tokenizer.cache
    assert not cache.disabled and cache.seam_checks >= 1
    # Every turn after a session's first extends a cached prompt; repeats are whole hits.
    assert cache.reuses >= cache.lookups - 4 - 1, (cache.reuses, cache.lookups)


def test_a_new_prompt_tokenizes_only_its_new_text(tokenizer: PromptTokenizer) -> None:
    encoded: list[int] = []

    def counting(text: str, special: bool) -> tuple[list[int], list[int]]:
        encoded.append(len(text))
        return tokenizer._encode(text, special)

    cache = PromptKeyCache(counting)
    document = _text(tokenizer, 2000, 7)
    question_a, question_b = _text(tokenizer, 30, 8), _text(tokenizer, 30, 9)
    cache.tokens(document + "\n" + question_a, True)
    cache.tokens(document + "\n" + question_a[::-1], True)  # the first reuse: checked by a whole encode
    encoded.clear()
    keys = cache.tokens(document + "\n" + question_b, True)
    assert keys.reused > 0 and keys.base is not None
    # Only the text after the document's last anchor was encoded: not the document again.
    assert sum(encoded) < len(question_b) + 2 * ANCHOR_CHARS, (encoded, len(document))
    assert tokenizer._tokenizer is not None
    assert list(keys.tokens) == list(tokenizer._tokenizer.encode(document + "\n" + question_b))


def test_the_cache_is_bounded(tokenizer: PromptTokenizer) -> None:
    cache = PromptKeyCache(tokenizer._encode, max_tokens=3000)
    for seed in range(20):
        cache.tokens(_text(tokenizer, 500, 200 + seed), True)
        assert cache._tokens <= 3000
    assert len(cache._prompts) <= 6
    # Anchors and whole-text keys of dropped prompts are gone with them.
    alive = {id(p) for p in cache._prompts.values()}
    assert all(id(p) in alive for p, _ in cache._anchors.values())
    assert all(id(p) in alive for p in cache._whole.values())


def test_a_tokenizer_whose_tokens_cross_whitespace_turns_reuse_off() -> None:
    """Tokens of two characters, whitespace included: an anchor is not a token start in
    general. The cache finds out at its first reuse and encodes whole texts from then on."""

    def pairs(text: str, special: bool) -> tuple[list[int], list[int]]:
        ids = [hash(text[i : i + 2]) % 50_000 for i in range(0, len(text), 2)]
        return ids, list(range(0, len(text), 2))

    cache = PromptKeyCache(pairs)
    base = " ".join(f"w{i}" for i in range(400))
    cache.tokens(base + " x", False)
    keys = cache.tokens(base + " yz", False)
    assert list(keys.tokens) == pairs(base + " yz", False)[0]
    if not cache.disabled:  # the anchor fell on an even character: the seam held
        assert keys.reused > 0
    for suffix in (" abc", "  d e", " fgh "):
        assert list(cache.tokens(base + suffix, False).tokens) == pairs(base + suffix, False)[0]


def test_chat_messages_match_the_chat_template(tokenizer: PromptTokenizer) -> None:
    tok = tokenizer._tokenizer
    assert tok is not None
    if not getattr(tok, "chat_template", None):
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        )
    history = [{"role": "system", "content": _text(tokenizer, 600, 11)}]
    for turn in range(3):
        history.append({"role": "user", "content": _text(tokenizer, 80, 20 + turn)})
        keys = tokenizer.tokens({"messages": list(history)})
        assert keys is not None
        expected = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        if not isinstance(expected, list):  # transformers 5 answers a BatchEncoding
            expected = expected["input_ids"]
        assert list(keys.tokens) == list(expected)
        history.append({"role": "assistant", "content": _text(tokenizer, 40, 40 + turn)})
