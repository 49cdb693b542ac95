"""A request's prompt for the router: where Serve's request object holds it, and its token ids.

``prompt_of`` finds the prompt (text, token ids, a batch, or chat messages), its
``cache_salt`` and its tenant label in a ``PendingRequest``; ``PromptTokenizer`` turns it into
the token ids vLLM would hash, with the model's own tokenizer (loaded once, on
the router's set-up thread, never on Serve's routing loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ray.serve.request_router import PendingRequest

from raykv.core.validate import request_params, request_tenant_value
from raykv.serve.prompt_keys import PromptKeyCache, PromptKeys

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

#: A request's prompt as ``prompt_of`` finds it: a text, token ids, a batch of either,
#: or ``{"messages": [...]}`` for a chat (whatever the request object holds).
Prompt = object


class RoutedPrompt(NamedTuple):
    """What the router reads of a request: its prompt (text, token ids, a batch, or
    ``{"messages": [...]}``), its ``cache_salt`` and its tenant label
    (``kv_transfer_params['tenant']``); all None when it has no prompt."""

    prompt: Prompt | None = None
    salt: str | None = None
    tenant: str | None = None


def prompt_of(pending_request: PendingRequest | None) -> RoutedPrompt:
    """The request's prompt, salt and tenant label (``RoutedPrompt``)."""
    if pending_request is None:
        return RoutedPrompt()
    for arg in list(pending_request.args or ()) + list((pending_request.kwargs or {}).values()):
        for attr in ("prompt", "messages"):
            value = _field(arg, attr)
            if value is not None:
                params = request_params(_field(arg, "kv_transfer_params"))
                tenant = request_tenant_value(params.get("tenant")) if params else None
                salt = _field(arg, "cache_salt")
                return RoutedPrompt(
                    value if attr == "prompt" else {"messages": value},
                    salt if isinstance(salt, str) else None,
                    tenant or None,
                )
    return RoutedPrompt()


def _field(arg: object, name: str) -> object:
    return arg.get(name) if isinstance(arg, dict) else getattr(arg, name, None)


class PromptTokenizer:
    """Token ids and block hashes of prompts, with the tokenizer at ``path`` (a model's
    path or hub id); text reuses what a recent prompt it extends had (``PromptKeyCache``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._error: Exception | None = None
        self._checked_backend: tuple[Tokenizer | None] | None = None
        self.cache = PromptKeyCache(self._encode)

    def load(self) -> None:
        """Load the tokenizer (seconds). One that does not load only stops routing
        of text prompts: token-id prompts still route."""
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        except Exception as e:  # noqa: BLE001 - kept for the decisions' error
            self._error = e

    def tokens(self, prompt: Prompt) -> PromptKeys | None:
        """The prompt's token ids (a batch: its first prompt's); None for a prompt of no known form."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return PromptKeys(prompt)
        if self._tokenizer is None:
            raise RuntimeError(f"tokenizer {self.path!r} did not load: {self._error!r}")
        if isinstance(prompt, str):
            return self.cache.tokens(prompt, True)
        if isinstance(prompt, dict):
            # What transformers' apply_chat_template(tokenize=True) does: render, then
            # encode without adding special tokens (the template writes them).
            messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt["messages"]]
            text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.cache.tokens(str(text), False)
        return None

    def block_hashes(self, keys: PromptKeys, tokens_per_hash: int, salt: str | None, algo: str) -> list[bytes]:
        """vLLM's block hashes of ``keys``' tokens (those of a cached prompt reused)."""
        return self.cache.block_hashes(keys, tokens_per_hash, salt, algo)

    def _encode(self, text: str, special: bool) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` and each one's first character (-1: a special token).

        With a fast tokenizer, its Rust tokenizer gives both in one call; it is used only
        where it splits a sample text as the transformers tokenizer does (vLLM's engines
        encode through the latter). Else no starts are known: only whole prompts repeat."""
        assert self._tokenizer is not None
        backend = self._backend()
        if backend is None:
            ids = list(self._tokenizer.encode(text, add_special_tokens=special))
            return ids, [-1] * len(ids)
        enc = backend.encode(text, add_special_tokens=special)
        return list(enc.ids), [-1 if m else o[0] for m, o in zip(enc.special_tokens_mask, enc.offsets)]

    def _backend(self) -> Tokenizer | None:
        if self._checked_backend is None:
            tokenizer = self._tokenizer
            backend: Tokenizer | None = getattr(tokenizer, "backend_tokenizer", None)
            sample = "Hello,  world!\n\tThe  quick brown fox's 42 jumps. \u00e9t\u00e9 \U0001f600 end "
            same = tokenizer is not None and backend is not None
            for special in (True, False):
                if same and tokenizer is not None and backend is not None:
                    same = list(backend.encode(sample, add_special_tokens=special).ids) == list(
                        tokenizer.encode(sample, add_special_tokens=special)
                    )
            self._checked_backend = (backend if same else None,)
        return self._checked_backend[0]
