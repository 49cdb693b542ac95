"""Token ids and block hashes of the router's prompts, reused from the prompt each one extends.

Serve traffic repeats itself: a chat's next turn is its last prompt plus a
message, a RAG or agent prompt is a long shared document plus a question. The
router needs each prompt's token ids and vLLM block hashes; computing them from
scratch is the bulk of a decision (a few ms for a 2k-token prompt, more on a
busy host). ``PromptKeyCache`` keeps the recent prompts' ids and hashes and, for
a new text, finds the longest recent prompt it extends at an *anchor*: the
first whitespace after every ``ANCHOR_CHARS`` characters, where byte-level BPE
and SentencePiece tokenizers start a new token. It then tokenizes only the text
after the anchor and hashes only the blocks after the cached ones.

The seam is exact for the pre-tokenizers vLLM's models use (GPT-2/Llama-3
regexes split before whitespace); a tokenizer whose tokens cross whitespace
could split the text after the anchor differently from a whole-text encode.
That costs routing accuracy only (the router reads the directory, it never
loads bytes), and ``PromptKeyCache`` checks the seam on a sample of its reuses:
a mismatch turns reuse off for the process (``disabled``).
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raykv.integrations.vllm.hashing import block_hashes

#: Characters between anchors (a prompt's reusable prefixes end at one).
ANCHOR_CHARS = 256
#: Token ids kept across the cached prompts (4 bytes each, plus their hashes).
DEFAULT_MAX_TOKENS = 1 << 20
#: One reuse in this many is checked against a whole-text encode.
CHECK_EVERY = 64

_WORD_END = re.compile(r"\S(?=\s)")

#: ``encode(text, add_special_tokens)`` -> (token ids, each token's start character;
#: -1 for special tokens). The router's tokenizer provides it (``raykv.serve.prompts``).
Encode = Callable[[str, bool], tuple[list[int], list[int]]]


@dataclass(eq=False)
class _Prompt:
    """A cached prompt: its token ids, and its block hashes per (block size, salt, algorithm)."""

    tokens: array[int]
    hashes: dict[tuple[int, str | None, str], list[bytes]] = field(default_factory=dict)
    digests: list[bytes] = field(default_factory=list)  # its anchors' and its whole text's keys


@dataclass
class PromptKeys:
    """One prompt's token ids, and what of them came from a cached prompt."""

    tokens: Sequence[int]
    base: _Prompt | None = None  # the cached prompt it extends (or is)
    reused: int = 0  # its leading tokens that are ``base``'s
    _entry: _Prompt | None = None  # its own cache entry (hashes computed land there)

    def __len__(self) -> int:
        return len(self.tokens)


class PromptKeyCache:
    """Recent prompts' token ids and block hashes, looked up by the text they start with."""

    def __init__(self, encode: Encode, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self._encode = encode
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()  # least recently used first
        self._anchors: dict[bytes, tuple[_Prompt, int]] = {}  # text key -> (prompt, tokens before it)
        self._whole: dict[bytes, _Prompt] = {}
        self._tokens = 0
        self.disabled = False
        self._suffix_ids: list[int] | None = None
        #: Lookups, and those that reused a cached prompt's tokens (whole or in part).
        self.lookups = 0
        self.reuses = 0
        self.extensions = 0  # reuses of part of a cached prompt (the others: a whole prompt again)
        self.seam_checks = 0

    # -- token ids -------------------------------------------------------------------
    def tokens(self, text: str, special: bool) -> PromptKeys:
        """``text``'s token ids (with the tokenizer's special tokens when ``special``)."""
        self.lookups += 1
        anchors, whole = _text_keys(text, special)
        if self.disabled:
            ids, _ = self._encode(text, special)
            return PromptKeys(ids)
        hit = self._whole.get(whole)
        if hit is not None:
            self.reuses += 1
            self._touch(hit)
            return PromptKeys(hit.tokens, hit, len(hit.tokens), hit)
        for i in range(len(anchors) - 1, -1, -1):
            pos, key = anchors[i]
            found = self._anchors.get(key)
            if found is not None:
                self.reuses += 1
                return self._extend(text, special, anchors, whole, i, *found)
        ids, starts = self._encode(text, special)
        entry = self._add(array("i", ids), anchors, whole, starts, 0, 0)
        return PromptKeys(entry.tokens, None, 0, entry)

    def _extend(
        self,
        text: str,
        special: bool,
        anchors: list[tuple[int, bytes]],
        whole: bytes,
        i: int,
        base: _Prompt,
        n_base: int,
    ) -> PromptKeys:
        pos = anchors[i][0]
        rest, starts = self._encode(text[pos:], False)
        suffix = self._suffix(special)
        tokens = base.tokens[:n_base]
        tokens.extend(rest)
        tokens.extend(suffix)
        self.extensions += 1
        if self.extensions % CHECK_EVERY == 1:
            self.seam_checks += 1
            if list(tokens) != self._encode(text, special)[0]:
                self.disabled = True  # this tokenizer's tokens cross an anchor: encode whole texts
                return PromptKeys(self._encode(text, special)[0])
        entry = self._add(tokens, anchors, whole, [pos + s if s >= 0 else -1 for s in starts], n_base, i + 1)
        # The anchors up to the seam now name the newer prompt (same tokens): they live as long as it does.
        for _, key in anchors[: i + 1]:
            found = self._anchors.get(key)
            if found is not None:
                self._anchors[key] = (entry, found[1])
                entry.digests.append(key)
        self._touch(base)
        return PromptKeys(entry.tokens, base, n_base, entry)

    def _suffix(self, special: bool) -> list[int]:
        """Special tokens the tokenizer appends to a text (an EOS, for some), when ``special``."""
        if not special:
            return []
        if self._suffix_ids is not None:
            return self._suffix_ids
        self._suffix_ids = []
        with_specials, _ = self._encode("a", True)
        bare, _ = self._encode("a", False)
        for at in range(len(with_specials) - len(bare) + 1):
            if with_specials[at : at + len(bare)] == bare:
                self._suffix_ids = with_specials[at + len(bare) :]
                break
        return self._suffix_ids

    def _add(
        self,
        tokens: array[int],
        anchors: list[tuple[int, bytes]],
        whole: bytes,
        starts: list[int],
        n_before: int,
        first_anchor: int,
    ) -> _Prompt:
        """Cache a prompt; its anchors from ``first_anchor`` on are those where one of its
        tokens (``starts``: from token ``n_before`` on) begins."""
        entry = _Prompt(tokens)
        at_token = {}
        for n, start in enumerate(starts):
            if start >= 0 and start not in at_token:
                at_token[start] = n_before + n
        for pos, key in anchors[first_anchor:]:
            if pos in at_token:
                self._anchors[key] = (entry, at_token[pos])
                entry.digests.append(key)
        self._whole[whole] = entry
        entry.digests.append(whole)
        self._prompts[id(entry)] = entry
        self._tokens += len(tokens)
        while self._tokens > self.max_tokens and len(self._prompts) > 1:
            self._drop(next(iter(self._prompts.values())))
        return entry

    def _touch(self, entry: _Prompt) -> None:
        if id(entry) in self._prompts:
            self._prompts.move_to_end(id(entry))

    def _drop(self, entry: _Prompt) -> None:
        del self._prompts[id(entry)]
        self._tokens -= len(entry.tokens)
        for key in entry.digests:
            if self._anchors.get(key, (None, 0))[0] is entry:
                del self._anchors[key]
            if self._whole.get(key) is entry:
                del self._whole[key]

    # -- block hashes ------------------------------------------------------------------
    def block_hashes(self, keys: PromptKeys, tokens_per_hash: int, salt: str | None, algo: str) -> list[bytes]:
        """vLLM's block hashes of ``keys``' tokens; the blocks it shares with its cached base
        prompt are not hashed again."""
        which = (tokens_per_hash, salt, algo)
        if keys._entry is not None and which in keys._entry.hashes:
            return keys._entry.hashes[which]
        done: list[bytes] = []
        if keys.base is not None:
            done = keys.base.hashes.get(which, [])[: keys.reused // tokens_per_hash]
        start = len(done) * tokens_per_hash
        out = done + block_hashes(keys.tokens, tokens_per_hash, salt, algo, start, done[-1] if done else None)
        if keys._entry is not None:
            keys._entry.hashes[which] = out
        return out


def _text_keys(text: str, special: bool) -> tuple[list[tuple[int, bytes]], bytes]:
    """``text``'s anchors (position, key of the text before it) and its whole text's key."""
    digest = hashlib.blake2b(b"s" if special else b"-", digest_size=16)
    anchors: list[tuple[int, bytes]] = []
    last = 0
    target = ANCHOR_CHARS
    while target < len(text):
        m = _WORD_END.search(text, target - 1)
        if m is None:
            break
        pos = m.start() + 1
        digest.update(text[last:pos].encode("utf-8", "surrogatepass"))
        anchors.append((pos, digest.copy().digest()))
        last = pos
        target = pos + ANCHOR_CHARS
    digest.update(text[last:].encode("utf-8", "surrogatepass"))
    digest.update(b"\x00end")
    return anchors, digest.digest()
