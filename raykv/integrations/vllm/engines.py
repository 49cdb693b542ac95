"""In-process vLLM engines for the demo and the benchmarks: the engine and its sampling parameters.

``raykv.demo`` steps engines and reads their outputs without importing vLLM;
what it needs of vLLM is built here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput

from raykv.core.wire import JsonValue

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokensPrompt", "build_llm", "greedy_params"]


def build_llm(
    model: str, kv_transfer_config: Mapping[str, JsonValue] | None, engine_kwargs: Mapping[str, JsonValue]
) -> LLM:
    """A ``vllm.LLM`` of ``model`` with the given offloading config and engine arguments."""
    # Engine arguments are named at run time (vLLM checks them): call it as a plain callable.
    llm: Callable[..., LLM] = LLM
    return llm(
        model=model,
        kv_transfer_config=None if kv_transfer_config is None else dict(kv_transfer_config),
        **engine_kwargs,
    )


def greedy_params(
    max_tokens: int,
    kv_transfer_params: Mapping[str, JsonValue] | None = None,
    logprobs: int | None = None,
    ignore_eos: bool = False,
) -> SamplingParams:
    """Greedy sampling of ``max_tokens`` tokens (``kv_transfer_params`` go to the connector)."""
    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=ignore_eos, extra_args=extra
    )
