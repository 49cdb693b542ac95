"""Routing by the directory: where each replica would find a request's prompt.

For one request (its prompt's tokens), the directory says, in one batched
lookup, which engines hold each leading block in their own KV cache
(``raykv.holders.engine_cache``) and which raykv tiers hold it. ``match`` turns that
into, per candidate replica, the blocks it would find in its engine cache, the
further blocks it would load from raykv (from this node's plasma or shared
storage, or pulled from another node), and what is left to recompute;
``rank`` weighs the prefill each replica saves against its queue.

The keys match vLLM's: the prefix-chained block hashes
(``raykv.integrations.vllm.hashing``) scoped by the engine's KV identity tag.
Pure functions; the Serve router (``raykv.serve.router``) does the I/O.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raykv.core.identity import KVIdentity
from raykv.core.keys import make_offload_key, pending_key
from raykv.core.placement import ENGINE, PLASMA, SHARED, HolderInfo
from raykv.core.tenants import tenant_key
from raykv.core.wire import PENDING
from raykv.holders.engine_cache import engine_key

#: Share of a block's prefill a load from raykv saves, by where it comes from
#: (an engine-cache hit saves all of it). Loads cost a transfer; remote plasma
#: pays a pull between nodes.
SAVED_SHARE = {"local": 0.6, "remote": 0.3}


@dataclass(frozen=True)
class EngineLayout:
    """What the router needs of an engine identity (``KVIdentity``) to name its keys."""

    tag: bytes
    tokens_per_hash: int
    blocks_per_chunk: int = 1

    @classmethod
    def from_identity(cls, tag_hex: str, identity: KVIdentity) -> "EngineLayout":
        """The layout of the engines of ``identity`` (tag ``tag_hex``)."""
        layout = identity.layout
        tokens, per_chunk = layout["tokens_per_hash"], layout.get("blocks_per_chunk", 1)
        if not isinstance(tokens, (int, str)) or not isinstance(per_chunk, (int, str)):
            raise ValueError(f"identity {tag_hex}: tokens_per_hash / blocks_per_chunk are not numbers: {layout}")
        return cls(bytes.fromhex(tag_hex), int(tokens), int(per_chunk))


def request_keys(hashes: Sequence[bytes], layout: EngineLayout, scope: bytes = b"") -> tuple[list[bytes], list[bytes]]:
    """(engine keys, one per block; tier keys, one per full chunk of ``blocks_per_chunk``
    blocks, in tenant scope ``scope`` as the tiers store them: ``raykv.core.tenants``)."""
    engine = [engine_key(layout.tag, h) for h in hashes]
    bpc = layout.blocks_per_chunk
    tier = [layout.tag + tenant_key(make_offload_key(hashes[i], 0), scope) for i in range(bpc - 1, len(hashes), bpc)]
    return engine, tier


@dataclass(frozen=True)
class Candidate:
    """A replica the router may choose: its id (opaque), the Ray actor running it, its node."""

    replica: Any
    owner: str | None
    node_id: str | None


@dataclass
class Match:
    """Leading prompt blocks one replica would find, by source."""

    engine: int = 0
    raykv_local: int = 0  # this node's plasma or shared storage
    raykv_remote: int = 0  # another node's plasma
    total: int = 0

    @property
    def raykv(self) -> int:
        return self.raykv_local + self.raykv_remote

    @property
    def recompute(self) -> int:
        return self.total - self.engine - self.raykv

    @property
    def saved(self) -> float:
        """Blocks of prefill saved (engine hits whole, raykv loads in part)."""
        return self.engine + SAVED_SHARE["local"] * self.raykv_local + SAVED_SHARE["remote"] * self.raykv_remote


def _engine_holder_of(holder: HolderInfo, candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate whose engine ``holder`` is: by owner actor, else the only candidate on its node."""
    if holder.owner:
        for c in candidates:
            if c.owner == holder.owner:
                return c
        return None
    on_node = [c for c in candidates if c.node_id == holder.node_id]
    return on_node[0] if len(on_node) == 1 else None


def match(
    engine_holders: Sequence[Sequence[HolderInfo]],
    tier_holders: Sequence[Sequence[HolderInfo]],
    blocks_per_chunk: int,
    candidates: Sequence[Candidate],
) -> dict[Any, Match]:
    """Per candidate replica, its ``Match`` for a request whose engine keys
    found ``engine_holders`` and whose tier keys found ``tier_holders``."""
    total = len(engine_holders)
    out = {c.replica: Match(total=total) for c in candidates}
    # Leading engine-cache run of each replica.
    alive = {c.replica for c in candidates}
    for i, holders in enumerate(engine_holders):
        here = {c.replica for h in holders if h.medium == ENGINE for c in [_engine_holder_of(h, candidates)] if c}
        for r in alive - here:
            out[r].engine = i
        alive &= here
        if not alive:
            break
    for r in alive:
        out[r].engine = total
    # Then what raykv's tiers hold of the prefix, chunk by chunk, per node.
    for c in candidates:
        m = out[c.replica]
        for chunk, holders in enumerate(tier_holders):
            end = min((chunk + 1) * blocks_per_chunk, total)
            if end <= m.engine:
                continue
            media = {(h.medium, h.node_id == c.node_id) for h in holders if h.medium != ENGINE}
            if not media:
                break
            n = end - max(chunk * blocks_per_chunk, m.engine)
            if (PLASMA, True) in media or any(med == SHARED for med, _ in media):
                m.raykv_local += n
            else:
                m.raykv_remote += n
    return out


def pending_keys(tier_keys: Sequence[bytes]) -> list[bytes]:
    """The pending-entry keys of ``tier_keys`` (``raykv.holders.pending``): who computes each chunk now."""
    return [pending_key(k) for k in tier_keys]


def computing(
    pending_holders: Sequence[Sequence[HolderInfo]],
    tier_holders: Sequence[Sequence[HolderInfo]],
    blocks_per_chunk: int,
    total: int,
    candidates: Sequence[Candidate],
) -> dict[Any, int]:
    """Per candidate replica, the prompt's leading blocks it will hold once its engine
    has computed what it is computing now: the end of the last chunk it lists as
    pending, when every chunk before that is held or pending somewhere."""
    out: dict[Any, int] = {}
    for chunk, pending in enumerate(pending_holders):
        held = chunk < len(tier_holders) and any(h.medium != ENGINE for h in tier_holders[chunk])
        if not held and not any(h.medium == PENDING for h in pending):
            break
        for h in pending:
            c = _engine_holder_of(h, candidates) if h.medium == PENDING else None
            if c is not None:
                out[c.replica] = min((chunk + 1) * blocks_per_chunk, total)
    return out


def credit_soon_held(matches: Mapping[Any, Match], soon: Mapping[Any, int]) -> None:
    """Blocks a replica is computing now (``soon``: replica -> leading blocks) count as
    held: on that replica as its engine cache's (they are, once computed), on the
    others as loads from raykv (they wait for its copy rather than compute them too:
    compute once), past what each finds already."""
    if not soon:
        return
    most = max(soon.values())
    for r, m in matches.items():
        mine = min(soon.get(r, 0), m.total)
        if mine > m.engine:
            rest = max(0, m.engine + m.raykv - mine)  # tier blocks past the ones it computes
            m.engine = mine
            m.raykv_local = min(m.raykv_local, rest)
            m.raykv_remote = rest - m.raykv_local
        covered = m.engine + m.raykv
        if min(most, m.total) > covered:
            m.raykv_remote += min(most, m.total) - covered


def affinity(first_key: bytes, replica_ids: Mapping[Any, str]) -> dict[Any, float]:
    """Per replica, a number in [0, 1) from the prompt's first block and the replica's
    id (rendezvous hashing): among replicas that tie, every router sends a prompt's
    new prefix to the same one, so a burst of requests sharing it is computed there once."""
    out = {}
    for r, rid in replica_ids.items():
        digest = hashlib.blake2b(first_key + rid.encode(), digest_size=8).digest()
        out[r] = int.from_bytes(digest, "big") / 2**64
    return out


@dataclass
class RankPolicy:
    """How the router trades saved prefill against load.

    A replica's cost is the blocks it would prefill plus, per request already
    queued or running there, ``load_weight`` times this request's blocks (the
    work ahead of it). A replica more than ``max_load_share`` times the mean
    queue (and at least ``min_queue_gap`` requests above the least loaded) is
    ranked after all others, whatever it holds.
    """

    load_weight: float = 0.1
    max_load_share: float = 1.5
    min_queue_gap: int = 2


def rank(
    matches: Mapping[Any, Match],
    queue_lens: Mapping[Any, int],
    policy: RankPolicy | None = None,
    spread: Mapping[Any, float] | None = None,
    ties: Mapping[Any, float] | None = None,
) -> list[list[Any]]:
    """Replicas best first, one per rank: the router's own total order.

    Within equal cost and queue, the replica given the least new work so far
    (``spread``: blocks it was sent to compute) comes first, then ``ties``
    (``affinity``; default chance): fresh prompts spread over the replicas.
    Serve tries the ranks in turn and takes a rank's replica unless it is full."""
    policy = policy or RankPolicy()
    if not matches:
        return []
    blocks = max(1, max(m.total for m in matches.values()))
    queues = {r: max(0, int(queue_lens.get(r, 0))) for r in matches}
    mean = sum(queues.values()) / len(queues)
    least = min(queues.values())
    spread = spread or {}

    def overloaded(r: Any) -> bool:
        q = queues[r]
        return q - least >= policy.min_queue_gap and q > policy.max_load_share * mean

    def cost(r: Any) -> float:
        m = matches[r]
        return (blocks - m.saved) + policy.load_weight * queues[r] * blocks

    ties = ties or {}
    chance = {r: ties[r] if r in ties else random.random() for r in matches}
    ordered = sorted(matches, key=lambda r: (overloaded(r), cost(r), queues[r], spread.get(r, 0.0), chance[r]))
    # No two replicas share a rank: Serve sends to the least loaded of a rank by its own
    # queue-length cache, which lacks the requests this router decided and Serve has not
    # sent yet (``ExpectedRoutes``), and prefers a replica it has a figure for to an idle
    # one whose figure expired. Its pick would then differ from the replica this decision
    # counts on, and a burst's second request would compute the prefix a second time.
    return [[r] for r in ordered]
