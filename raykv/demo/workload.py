"""Multi-turn, shared-prefix request traces (demo and ``raykv bench e2e``).

Every session starts with the same system prompt, then grows turn by turn:
turn ``t`` sends the system prompt, the session's document and all earlier
turns (user tokens plus a fixed synthetic assistant reply). Prompts are fixed
in advance, so runs with different caches send identical requests.
Requests go round-robin over the replicas in (turn, session) order.
"""

from __future__ import annotations

from dataclasses import dataclass

from raykv.demo.tiny_model import make_prompt_tokens

#: Tokens of the (synthetic) assistant reply that each turn appends to the
#: history: replicas generate this many tokens per request, so the next turn
#: follows a whole answer, as a client's would.
REPLY_TOKENS = 32


@dataclass(frozen=True)
class TraceRequest:
    index: int
    session: int
    turn: int
    replica: int
    prompt_token_ids: list[int]


def build_trace(
    sessions: int = 5,
    turns: int = 4,
    replicas: int = 2,
    system_tokens: int = 384,
    document_tokens: int = 256,
    turn_tokens: int = 192,
    seed: int = 0,
) -> list[TraceRequest]:
    """The requests of ``sessions`` conversations of ``turns`` turns each."""
    system = make_prompt_tokens(system_tokens, seed=10_000 + seed)
    history = [system + make_prompt_tokens(document_tokens, seed=20_000 + 97 * seed + s) for s in range(sessions)]
    out: list[TraceRequest] = []
    for t in range(turns):
        for s in range(sessions):
            user = make_prompt_tokens(turn_tokens, seed=30_000 + 1009 * seed + 31 * s + t)
            prompt = history[s] + user
            i = len(out)
            out.append(TraceRequest(i, s, t, i % replicas, prompt))
            reply = make_prompt_tokens(REPLY_TOKENS, seed=40_000 + 1009 * seed + 31 * s + t)
            history[s] = prompt + reply
    return out


def oracle_hits(prompts: list[list[int]], block_tokens: int) -> list[int]:
    """Per prompt (in arrival order), the prefix tokens one unbounded, cluster-wide
    cache would hit: every full block a prompt computed is cached, and a prompt
    hits at most ``len - 1`` tokens (its last token is always computed), in full blocks."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for tokens in prompts:
        hit = 0
        for b in range((len(tokens) - 1) // block_tokens):
            if tuple(tokens[: (b + 1) * block_tokens]) in seen:
                hit = b + 1
            else:
                break
        out.append(hit * block_tokens)
        for b in range(len(tokens) // block_tokens):
            seen.add(tuple(tokens[: (b + 1) * block_tokens]))
    return out


def oracle_hit_tokens(trace: list[TraceRequest], block_tokens: int) -> int:
    """The trace's total of `oracle_hits`."""
    return sum(oracle_hits([r.prompt_token_ids for r in trace], block_tokens))


def model_len_for(trace: list[TraceRequest], block_tokens: int, output_tokens: int = 16) -> int:
    """A ``max_model_len`` that fits every prompt of ``trace`` plus its output, in whole blocks."""
    longest = max(len(r.prompt_token_ids) for r in trace) + output_tokens
    return -(-longest // block_tokens) * block_tokens
