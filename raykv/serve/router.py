"""``RaykvRequestRouter``: a Ray Serve request router that routes by raykv's directory.

For each request it tokenizes the prompt (the model's tokenizer; token-id
prompts as they are; text after the longest recent prompt it extends only,
``raykv.serve.prompt_keys``), names the prompt's blocks as vLLM does, asks the
directory in one batched call which engines hold each leading block in their
own KV cache and which raykv tiers hold it, and ranks the candidate replicas by
the prefill they would save, weighed against their queues
(``raykv.serve.routing``). Serve then sends the request to the least loaded replica
of the first rank that has room. Anything that goes wrong (no prompt, no
tokenizer, no engine identity yet, a slow directory) falls back to Serve's
power-of-two-choices: routing never fails a request.

Turn it on with ``raykv.serve.build_app(..., router="raykv")`` or ``router:
raykv`` in a Serve YAML: that also turns on the engines' KV events, which
record each engine's own cache in the directory (``raykv.holders.engine_cache``).
Supported: Ray 2.60's public ``ray.serve.request_router`` API (alpha) and nothing
of Serve's private modules or attributes; vLLM 0.29, 0.32 and 0.33 block hashing
(``raykv.serve.routing`` reads the installed release's ``cache_salt`` form).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from raykv.core.tenants import engine_salt
from raykv.core.validate import ArgumentError
from raykv.integrations.vllm.hashing import prepare_hashing
from raykv.metrics.catalog import record
from raykv.serve.layout_book import LayoutBook
from raykv.serve.load_book import RecentPrefixes, RouterBook
from raykv.serve.prompts import PromptTokenizer, prompt_of
from raykv.serve.routing import (
    Candidate,
    EngineLayout,
    Match,
    RankPolicy,
    affinity,
    computing,
    credit_soon_held,
    match,
    pending_keys,
    rank,
    request_keys,
)

if TYPE_CHECKING:
    from raykv.core.wire import HolderInfo
    from raykv.directory.client import AgentClient, DirectoryClient
    from raykv.services.cluster import RaykvServices

logger = logging.getLogger(__name__)

#: How long a decision waits for the router's one-off set-up (vLLM's hashing, the
#: tokenizer) before it falls back to power of two choices.
PREPARE_TIMEOUT_S = 60.0


class RaykvRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes each request to the replica that would prefill the least, queues considered.

    Built on Ray 2.60's public ``ray.serve.request_router`` classes only. Its
    fallback is Serve's power of two choices, written here on the public mixins'
    helpers (``power_of_two``): Ray 2.60 exports no ``PowerOfTwoChoicesRequestRouter``
    (only Serve's private request_router package has it; ``ray.serve.request_router``'s
    ``__all__`` is FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID,
    RequestRouter, RunningReplica), and subclassing it would bring ``FIFOMixin``,
    which hands the replica one routing task chose to the oldest pending request
    (this router chooses per prompt: without it, Serve gives the replica to the
    request it was chosen for).
    """

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs as keywords
        self,
        model: str | None = None,
        namespace: str = "raykv",
        tokenizer: str | None = None,
        load_weight: float = 0.1,
        max_load_share: float = 1.5,
        min_queue_gap: int = 2,
        lookup_timeout_s: float = 0.2,
        hash_algo: str = "sha256",
    ) -> None:
        """Router options (``request_router_kwargs``); ``build_app(router="raykv")`` fills them."""
        if not model or not isinstance(model, str):
            raise ArgumentError("model", "the model's path or hub id is required (its tokenizer and KV identity)")
        for name, value in (("load_weight", load_weight), ("max_load_share", max_load_share)):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ArgumentError(name, f"must be a number >= 0, got {value!r}")
        if not isinstance(lookup_timeout_s, (int, float)) or not 0 < lookup_timeout_s <= 10:
            raise ArgumentError("lookup_timeout_s", f"must be in (0, 10] seconds, got {lookup_timeout_s!r}")
        self._book = LayoutBook(model, namespace)
        self._prompt_tokens = PromptTokenizer(tokenizer or model)
        self._policy = RankPolicy(float(load_weight), float(max_load_share), int(min_queue_gap))
        self._lookup_timeout_s = float(lookup_timeout_s)
        #: Keys a decision found unknown to the node's view (asked of the agent, not waited for).
        self._asked_unknown = 0
        self._hash_algo = hash_algo
        self._warned: dict[str, float] = {}
        # The metrics' "deployment" tag: the name of the deployment this router routes to,
        # read off its replicas' public ReplicaID.deployment_id at the first decision. Ray
        # 2.60's RequestRouter keeps its DeploymentID in a private attribute, and has no
        # public accessor for it (``app_name`` is public, the deployment's name is not).
        self._tags: dict[str, str] = {"deployment": ""}
        self.decisions = 0
        self.fallbacks = 0
        #: what it sent where: in flight, decided, new work, prefixes held soon
        self._sent: RouterBook[ReplicaID] = RouterBook()
        # The one-off set-up (importing vLLM's hashing, loading the tokenizer: seconds)
        # runs on a thread from the start, never on Serve's routing event loop.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raykv-router-prepare")
        self._prepared = pool.submit(self._prepare)
        pool.shutdown(wait=False)

    # -- Serve's API -----------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if candidate_replicas and not self._tags["deployment"]:
            self._tags = {"deployment": candidate_replicas[0].replica_id.deployment_id.name}
        ranks = None
        reason = "unranked"  # no prompt, no engine layout known yet, too few candidates
        try:
            ranks = await self._rank(candidate_replicas, pending_request)
        except Exception as e:  # noqa: BLE001 - routing falls back, never fails a request
            reason = "error"
            self._warn(type(e).__name__, f"raykv router: falling back to power of two choices: {e!r}")
        if not ranks:
            self.fallbacks += 1
            if len(candidate_replicas) > 1:  # (one candidate is no choice to fall back from)
                record("raykv_router_fallbacks", 1, {**self._tags, "reason": reason})
            return self.power_of_two(candidate_replicas, pending_request)
        self.decisions += 1
        if pending_request is not None:
            # Every candidate is ranked: if none has room, Serve backs off before asking
            # again (as after its own routers' last locality tier), not a busy loop.
            pending_request.routing_context.should_backoff = True
        record("raykv_router_decision_seconds", time.perf_counter() - t0, self._tags)
        # (a decision awaits nothing once the router is set up, so this is its own CPU time)
        record("raykv_router_decision_cpu_seconds", time.thread_time() - cpu0, self._tags)
        return ranks

    def power_of_two(
        self, candidate_replicas: Sequence[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Serve's power of two choices (what Ray 2.60's ``PowerOfTwoChoicesRequestRouter``
        does, on the public mixins' helpers): the replicas holding the request's
        multiplexed model, else the local ones (node, then zone), else all; two of them
        at random, of which Serve takes the one with the shorter queue."""
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            ids = self.apply_locality_routing(pending_request=pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        pool = [by_id[i] for i in ids if i in by_id]
        return [random.sample(pool, min(2, len(pool)))] if pool else []

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        """Serve's hook once a replica accepted a request: count it in flight there
        until ``on_request_completed``, and the blocks it will compute there.

        Ray 2.60 calls it for each request a replica accepted under Serve's rejection
        protocol (strict ``max_ongoing_requests``, on except in Ray Client), on the
        router's event loop; without the protocol it is not called and the queue
        figure is Serve's alone (``queue_lens``)."""
        internal_id = pending_request.metadata.internal_request_id
        self._sent.routed(id(pending_request), internal_id, replica_id, time.monotonic())
        logger.debug("raykv router: %s routed to %s", internal_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve's hook once a request sent to a replica ended (done, failed,
        cancelled or rejected; Ray 2.60 calls it on the router's event loop): it
        leaves the replica's in-flight count.

        A completion of a request not counted (a rejected send, or one whose end
        was heard before its ``on_request_routed``) is remembered a while, so that a
        late ``on_request_routed`` of it counts nothing: the count may miss a
        request, never keep one that ended."""
        self._sent.inflight.completed(internal_request_id, replica_id)

    # -- the decision ------------------------------------------------------------
    async def _rank(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]] | None:
        if len(candidates) < 2:
            return None
        if pending_request is not None:  # decided again (all full before): not queued twice
            self._sent.expected.settled(id(pending_request))
        prompt, salt, tenant = prompt_of(pending_request)
        if prompt is None:
            return None
        await self._wait_prepared()
        clock = _StageClock()
        tokens = self._prompt_tokens.tokens(prompt)
        clock.lap("tokenize")
        layouts = await self._book.layouts()
        clock.lap("identities")
        if not tokens or not layouts:
            return None
        # The engine hashes a labelled tenant's prompt with a derived salt, and the
        # tiers scope its keys (raykv.core.tenants): the same here, or nothing matches.
        scope = self._book.sharing.scope_of_tenant(tenant)
        salt = engine_salt(salt, scope)
        services = self._book.services
        # Who computes each chunk now (engines' pending entries), when the namespace lists them.
        with_pending = services is not None and bool(getattr(services.config, "pending_entries", False))
        keys: list[bytes] = []
        spans: list[Span] = []
        engine_keys: list[bytes] = []
        for layout in layouts:
            hashes = self._prompt_tokens.block_hashes(tokens, layout.tokens_per_hash, salt, self._hash_algo)
            engine, tier = request_keys(hashes, layout, scope)
            pending = pending_keys(tier) if with_pending else []
            spans.append((layout, len(keys), len(engine), len(tier), len(pending), engine))
            keys += engine + tier + pending
            engine_keys += engine
        clock.lap("hash")
        matches: dict[RunningReplica, Match]
        if not keys:  # shorter than a block: only load matters
            matches = {r: Match() for r in candidates}
        else:
            if services is None:  # (layouts come from the services: attached by now)
                return None
            found = await self._holders(services, keys)
            clock.lap("directory")
            matches = _matches(found, spans, candidates, self._sent.recent)
        spread = {r: self._sent.work.sent(r.replica_id) for r in candidates}
        ties = affinity(engine_keys[0], {r: _actor_hex(r) for r in candidates}) if engine_keys else None
        queues = self.queue_lens(candidates)
        ranks: list[list[RunningReplica]] = rank(matches, queues, self._policy, spread, ties)
        if pending_request is not None:
            computes = {r.replica_id: m.recompute for r, m in matches.items()}
            first = ranks[0][0].replica_id
            self._sent.decided(id(pending_request), first, computes, engine_keys, self.decisions, time.monotonic())
            if logger.isEnabledFor(logging.DEBUG):
                _log_decision(pending_request.metadata.internal_request_id, ranks, matches, queues)
        best = matches[ranks[0][0]]
        block_tokens = layouts[0].tokens_per_hash
        for source, blocks in (("engine", best.engine), ("raykv", best.raykv)):
            record("raykv_router_prompt_tokens", blocks * block_tokens, {**self._tags, "source": source})
        recompute = max(0, len(tokens) - (best.engine + best.raykv) * block_tokens)
        record("raykv_router_prompt_tokens", recompute, {**self._tags, "source": "recompute"})
        clock.lap("rank")
        for stage, seconds in clock.laps.items():
            record("raykv_router_stage_seconds", seconds, {**self._tags, "stage": stage})
        return ranks

    async def _holders(self, services: RaykvServices, keys: list[bytes]) -> list[list[HolderInfo]]:
        """Each key's holders. With a node view (``directory_agent``) the decision reads
        it and makes no call: keys it does not know count as held by nobody this time,
        and are sent to the agent without waiting, so the view (kept current by the
        shards' feeds) knows them for the next request with this prefix. Without one:
        one call per shard, waited for up to the lookup timeout."""
        cache = services.lookup_cache
        view = cache.view
        if view is None:
            return await services.directory.lookup_async(keys).result_async(self._lookup_timeout_s)
        known = view.lookup(keys)
        unknown = [k for k, h in zip(keys, known) if h is None]
        if unknown:
            self._asked_unknown += len(unknown)
            # sent once the decision is made (its answer lands in the view), not in it
            asyncio.get_running_loop().call_soon(self._ask_agent, cache.client, unknown)
        return [h if h is not None else [] for h in known]

    def _ask_agent(self, client: AgentClient | DirectoryClient, keys: list[bytes]) -> None:
        try:
            client.lookup_async(keys)
        except Exception as e:  # noqa: BLE001 - only the view's next answers miss them
            self._warn("agent", f"raykv router: keys not sent to the directory agent: {e!r}")

    def queue_lens(self, candidates: Sequence[RunningReplica]) -> dict[RunningReplica, int]:
        """Each candidate's ongoing requests: what this router sent there and is not
        done (``on_request_routed`` .. ``on_request_completed``) plus those it decided
        to send there that Serve has not reported routed yet (``ExpectedRoutes``), or
        Serve's cached figure when higher. No probe: Serve probes the
        replicas of the chosen rank itself, and a probe per request to every replica
        is what made the first version of this router slow under load.

        Serve's figure is the public ``RequestRouter.replica_queue_len_cache``
        property's ``get(replica_id)`` (Ray 2.60): None when it has no fresh entry."""
        cache = self.replica_queue_len_cache
        queues = self._sent.queues({r.replica_id: cache.get(r.replica_id) for r in candidates}, time.monotonic())
        return {r: queues[r.replica_id] for r in candidates}

    # -- what it needs once (or now and then) --------------------------------------
    def _prepare(self) -> None:
        """Import vLLM's hashing and load the tokenizer (on the set-up thread)."""
        prepare_hashing(self._hash_algo)
        self._prompt_tokens.load()

    async def _wait_prepared(self) -> None:
        """Until the set-up is done (shared by concurrent decisions; the event loop runs on)."""
        if not self._prepared.done():
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._prepared)), PREPARE_TIMEOUT_S)
        self._prepared.result()  # its error, if any: this decision falls back

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -1e9) >= 10.0:
            self._warned[kind] = now
            logger.warning(message)


class _StageClock:
    """Seconds spent in each named stage of one decision (``lap`` closes the stage that just ran)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self._last
        self._last = now


#: One engine layout's part of a decision's keys: (layout, where its keys start, how many
#: engine keys, tier keys and pending keys it has, its engine keys).
Span = tuple[EngineLayout, int, int, int, int, list[bytes]]


def _matches(
    found: list[list[HolderInfo]],
    spans: list[Span],
    candidates: list[RunningReplica],
    recent: RecentPrefixes[ReplicaID],
) -> dict[RunningReplica, Match]:
    """Per candidate, what it would find of the prompt (the best of the model's layouts):
    ``match``, then blocks being computed now count as held soon (``credit_soon_held``):
    what this router sent where lately, and engines' pending entries (other routers' requests)."""
    views = [Candidate(r, _actor_hex(r), r.node_id) for r in candidates]
    by_id = {r.replica_id: r for r in candidates}
    now = time.monotonic()
    matches: dict[RunningReplica, Match] = {}
    for layout, start, n_engine, n_tier, n_pending, engine in spans:
        engine_found = found[start : start + n_engine]
        tier_found = found[start + n_engine : start + n_engine + n_tier]
        pending_found = found[start + n_engine + n_tier : start + n_engine + n_tier + n_pending]
        layout_matches = match(engine_found, tier_found, layout.blocks_per_chunk, views)
        soon = computing(pending_found, tier_found, layout.blocks_per_chunk, len(engine), views)
        for rid, n in recent.leading(engine, now).items():
            if rid in by_id:
                soon[by_id[rid]] = max(soon.get(by_id[rid], 0), n)
        credit_soon_held(layout_matches, soon)
        for r, m in layout_matches.items():
            if r not in matches or m.saved > matches[r].saved:
                matches[r] = m
    return matches


def _log_decision(
    request_id: str,
    ranks: list[list[RunningReplica]],
    matches: dict[RunningReplica, Match],
    queues: dict[RunningReplica, int],
) -> None:
    logger.debug(
        "raykv router: %s ranks %s (engine/raykv/recompute blocks %s, queues %s)",
        request_id,
        [[r.replica_id.unique_id for r in group] for group in ranks],
        {r.replica_id.unique_id: (m.engine, m.raykv, m.recompute) for r, m in matches.items()},
        {r.replica_id.unique_id: q for r, q in queues.items()},
    )


def _actor_hex(replica: RunningReplica) -> str:
    """The Ray actor running the replica (hex; engines register under it), from the public ``actor_id``."""
    return replica.actor_id.hex()
