"""What an ``EngineReplica`` actor answers (``raykv.demo.replicas``): typed on both sides."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaReady:
    """A replica's answer to ``ready()``: where its engine runs and how long it took to load."""

    node_id: str
    load_s: float
    pid: int


@dataclass(frozen=True)
class Completion:
    """What one request gave: cache hits, time to first token, output."""

    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float  # from the request's arrival at the replica to its first output token
    token_ids: list[int]
    top_logprobs: list[tuple[int, float]]  # first output token's top-k
    decode_ms_per_token: float | None = None  # after the first token; None for one-token outputs
    #: per output token, the top two logprobs: where they are within float
    #: noise, another run may pick the other token (`raykv.demo.correctness`)
    top2: list[tuple[float, float]] | None = None
