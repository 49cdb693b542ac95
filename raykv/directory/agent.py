"""``DirectoryAgent``: one per node, between the node's engines and the directory shards.

- It follows every shard's change feed into a ``NodeView``: all keys of the
  node's own holders, and the answers its engines asked for, updated by the
  feeds rather than by a TTL. The feed page rides on the agent's own calls to
  a shard (``ShardBatch.follow``); a shard it has not called for
  ``FEED_INTERVAL_S`` gets a long-poll ``changes`` call instead.
- It publishes the view in shared memory (``raykv.directory.shm_view``):
  engines answer lookups the view can settle with no Ray call at all.
- Keys an engine's read of the view did not settle come to ``lookup``, and go
  to the shards (the view may lag them by a few ms). Calls arriving within one
  window (``agent_window_ms``, 2 ms by default: under one engine step, and
  long enough that the 8 engines of a node stepping together share a call)
  are merged into one call per shard for their distinct keys.

Losing the agent costs misses, never wrong bytes: engines then miss on what
the view would have answered (their calls fail into "nobody holds it"), Ray
restarts it (``max_restarts=-1``) and it rebuilds from the feeds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import cast

import numpy as np
import ray
from ray.actor import ActorClass, ActorHandle

from raykv.core import naming
from raykv.core.wire import LookupReply
from raykv.directory.agent_state import AgentState, FeedPosition
from raykv.directory.fingerprint import from_blob, to_blob
from raykv.directory.messages import AgentStats, FeedOp, FeedPage, ShardBatchReply
from raykv.directory.replaced import take_replacement
from raykv.directory.shm_view import ViewWriter, published_view, view_path
from raykv.directory.window import AgentWindow
from raykv.metrics import status_log
from raykv.metrics.recorders import AgentFigures, publish_agent_metrics

logger = logging.getLogger(__name__)

#: How long one feed call waits at the shard for a change. The shard answers at once when
#: there is one, so this sets only a quiet node's idle calls: 10 s against 1 s cut four idle
#: agents from 0.042 to 0.031 cores and two shards from 0.027 to 0.018 (2026-11-29).
FEED_WAIT_S = 10.0
#: A shard that sent no feed page for this long (neither a ``changes`` page with entries nor
#: an ``apply`` reply's) is asked with a long poll; a busy node's pages ride on its windows'
#: calls instead. Replica lag is at most about this plus a round trip (target: 100 ms at p99):
#: on the bench trace 85 ms gave lag p99 85-88 ms; 20 ms gave 28 ms but ~3x the calls.
FEED_INTERVAL_S = 0.085
#: Windows with only holders' registrations and evictions are sent at most once per this long
#: (a lookup closes a window after ``agent_window_ms``). Their calls bring the feed pages too, so
#: this is also the replica lag of a busy node. A tier's store job answers after its registration,
#: so a store waits up to this long: sending those sooner cost 3-4x the calls per shard
#: (docs/PERFORMANCE.md, "Store jobs wait for the agent's changes-only window").
CHANGE_WINDOW_S = 0.085
#: Pause before following a shard again after its call failed (it is down or restarting).
RETRY_PAUSE_S = 0.2
#: Longest a just-started agent holds lookups back until it follows every shard's feed.
START_WAIT_S = 1.0
#: Most replica lags one metrics round records (the latest ones).
MAX_LAGS_PER_ROUND = 200
#: The writer's heartbeat period (readers stop trusting a view whose writer is silent for 5 s).
BEAT_S = 0.5


@ray.remote(num_cpus=0, max_restarts=-1)
class DirectoryAgent:
    """Named actor ``raykv-directory-agent-<node id>``: a node's directory agent."""

    def __init__(
        self,
        namespace: str,
        node_id: str,
        shards: list[ActorHandle],
        window_ms: float,
        max_keys: int,
        all_keys: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()  # first: a failed start leaves no file behind
        self.namespace, self.node_id = namespace, node_id
        self.shards = shards
        self.window_s = window_ms / 1000.0
        self.writer, view = published_view(view_path(namespace, node_id), node_id, max_keys, all_keys)
        self._reading = 0  # shards whose holders' keys are being read
        self.state = AgentState(view, len(shards))
        self.started_at = time.time()
        self.calls: Counter[str] = Counter()
        self.lookups = self.keys_asked = 0
        self.changes = 0  # holders' register / unregister calls taken
        self._window = AgentWindow()
        # The window's flush and when it runs (uvloop's call_at of a time already
        # past returns a plain Handle, which has no ``when()``: kept here instead).
        self._flush: asyncio.Handle | None = None
        self._flush_at = 0.0
        #: Per shard, when the last feed page came or was asked for (loop time).
        self._paged_at = [0.0] * len(shards)
        self._last_close = 0.0  # when the last window was sent (loop time)
        #: Set once every shard's feed is followed: answers before that could not be kept.
        self._following = asyncio.Event()
        self._tasks = [loop.create_task(self._follow(i)) for i in range(len(shards))]
        self._tasks.append(loop.create_task(_beat(self.writer)))
        self._tasks.append(loop.create_task(publish_agent_metrics(node_id, self._figures)))
        self._status_log = status_log.spawn(self.status_line, namespace=namespace)

    def __repr__(self) -> str:
        node = str(self.__dict__.get("node_id"))[:12]
        return f"DirectoryAgent(node {node}, namespace {self.__dict__.get('namespace')!r})"

    # -- the feeds -------------------------------------------------------------
    async def _follow(self, shard: int) -> None:
        """Apply ``shard``'s change feed as it comes, for as long as the agent lives.

        While the agent sends ``apply`` calls to the shard (each carries the feed
        page after the view's position) it makes no ``changes`` call of its own:
        it asks only once ``FEED_INTERVAL_S`` has passed without a page."""
        state, loop = self.state, asyncio.get_running_loop()
        while True:
            pos = state.positions[shard]
            quiet_until = self._paged_at[shard] + FEED_INTERVAL_S
            if pos.epoch and self._flush is not None and self._window.covers(shard):
                quiet_until = max(quiet_until, self._flush_at)  # the window's call brings the page
            if pos.epoch and loop.time() < quiet_until:
                await asyncio.sleep(quiet_until - loop.time() + 0.001)
                continue
            asked = FeedPosition(pos.epoch, pos.seq)
            try:
                self.calls["changes"] += 1
                page: FeedPage = await self.shards[shard].changes.remote(asked.epoch, asked.seq, FEED_WAIT_S)
            except Exception as e:  # down or restarting: its keys can no longer be followed
                resync = state.lost(shard)
                if resync:
                    logger.info("directory shard %d unreachable (%s): view reset", shard, type(e).__name__)
                await take_replacement(self.shards, self.namespace, shard, e, self.calls)
                await self._read_holders(resync)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            await self._caught_up(state.apply(shard, page, asked))
            if page.entries:  # busy: let the next changes gather
                self._paged_at[shard] = loop.time()

    async def _caught_up(self, resync: list[int]) -> None:
        """After a page: read the holders of ``resync`` again (a gap), then note
        whether every feed is followed (and an all-keys view complete)."""
        state = self.state
        await self._read_holders(resync)
        if state.followed():
            self._following.set()
            if not self._reading:  # every holder of every shard read (all_keys views)
                state.view.complete = True

    async def _read_holders(self, shards: list[int]) -> None:
        """Put every key of ``shards``' holders the view follows (``holders_to_read``) in it."""
        if not shards:
            return
        self._reading += 1
        try:
            for shard in shards:
                for info in self.state.holders_to_read(shard):
                    try:
                        self.calls["holder_fingerprints"] += 1
                        fps: np.ndarray = await self.shards[shard].holder_fingerprints.remote(info.holder_id)
                    except Exception as e:  # the shard went down again: its gap brings us back here
                        logger.debug("keys of %s at shard %d unavailable: %r", info.holder_id, shard, e)
                        continue
                    self.state.view.register(shard, info.holder_id, to_blob(fps))
        finally:
            self._reading -= 1

    # -- engines' lookups, holders' changes -----------------------------------------
    async def _started(self) -> None:
        """A just-started agent follows the feeds first (a shard down: go on after a second)."""
        if not self._following.is_set():
            try:
                await asyncio.wait_for(self._following.wait(), START_WAIT_S)
            except asyncio.TimeoutError:
                pass

    def _window_now(self, within_s: float) -> AgentWindow:
        """The window collecting now, closing at most ``within_s`` from now."""
        loop = asyncio.get_running_loop()
        close_at = loop.time() + within_s
        if self._flush is not None and self._flush_at > close_at:
            self._flush.cancel()
            self._flush = None
        if self._flush is None:
            self._flush = loop.call_at(close_at, self._close_window)
            self._flush_at = close_at
        return self._window

    async def lookup(self, fps_blob: bytes, shards_blob: bytes) -> LookupReply:
        """Holders of the keys with fingerprints ``fps_blob`` (``to_blob``), each
        owned by the shard in ``shards_blob`` (uint16 per key), in that order."""
        await self._started()
        fps = from_blob(fps_blob)
        self.lookups += 1
        self.keys_asked += len(fps)
        # Engines ask only what their read of the view did not settle (or what a failed
        # load made them distrust): the shards answer, not this view, which may lag.
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._window_now(self.window_s).lookup(fps, np.frombuffer(shards_blob, dtype="<u2"), future)
        return self.state.view.reply(await future)

    async def register(self, holder_id: str, fps_blob: bytes, shards_blob: bytes) -> int:
        """A holder of this node now holds these keys (sent with the window's other calls)."""
        return await self._change(FeedOp.REGISTER, holder_id, fps_blob, shards_blob)

    async def unregister(self, holder_id: str, fps_blob: bytes, shards_blob: bytes) -> int:
        """A holder of this node no longer holds these keys."""
        return await self._change(FeedOp.UNREGISTER, holder_id, fps_blob, shards_blob)

    async def _change(self, op: FeedOp, holder_id: str, fps_blob: bytes, shards_blob: bytes) -> int:
        # No await before the window takes it: a holder's calls keep their order.
        self.changes += 1
        # At most one changes-only window per CHANGE_WINDOW_S: a change after a quiet spell goes at once
        # (after ``window_s``), a steady stream goes out every CHANGE_WINDOW_S.
        loop = asyncio.get_running_loop()
        window = self._window_now(max(self.window_s, self._last_close + CHANGE_WINDOW_S - loop.time()))
        futures = window.change(op, holder_id, from_blob(fps_blob), np.frombuffer(shards_blob, "<u2"))
        return sum(await asyncio.gather(*futures))

    def _close_window(self) -> None:
        loop = asyncio.get_running_loop()
        self._flush = None
        self._last_close = loop.time()
        window, self._window = self._window, AgentWindow()
        asked: dict[int, FeedPosition] = {}
        refs: dict[int, ray.ObjectRef[ShardBatchReply]] = {}
        # Sent now, in window order: one agent's calls to a shard run in the order sent.
        for shard, batch in window.batches().items():
            pos = self.state.positions[shard]
            if pos.epoch:  # the reply brings the feed page: no ``changes`` call needed for a while
                asked[shard] = FeedPosition(pos.epoch, pos.seq)
                batch = dataclasses.replace(batch, follow=(pos.epoch, pos.seq))
                self._paged_at[shard] = self._last_close
            refs[shard] = self.shards[shard].apply.remote(batch)
        self.calls["apply"] += len(refs)
        self.calls["merged_engine_calls"] += window.engine_calls
        loop.create_task(self._settle(window, refs, asked))

    async def _settle(
        self,
        window: AgentWindow,
        refs: dict[int, ray.ObjectRef[ShardBatchReply]],
        asked: dict[int, FeedPosition],
    ) -> None:
        try:
            replies = await asyncio.gather(*refs.values(), return_exceptions=True)
            by_shard = dict(zip(refs, replies))
            resync: set[int] = set()
            for shard, reply in by_shard.items():  # pages first: the lookups' answers were taken after them
                if isinstance(reply, ShardBatchReply) and reply.page is not None:
                    resync.update(self.state.apply(shard, reply.page, asked[shard]))
            window.settle(by_shard, self.state.answer)
            if resync:  # a gap: re-read holders once the engines have their answers, not before
                await self._caught_up(sorted(resync))
        except Exception as e:  # never leave a caller waiting
            logger.warning("directory agent window failed: %r", e)
            window.fail(e)

    # -- reports -------------------------------------------------------------------
    def _figures(self) -> AgentFigures:
        view = self.state.view
        return AgentFigures(
            view_keys=view.known_keys(),
            local_keys=view.local_keys(),
            engine_calls=self.lookups,
            shard_calls={k: v for k, v in self.calls.items() if k != "merged_engine_calls"},
            resets=view.resets,
            lags=self.state.new_lags(MAX_LAGS_PER_ROUND),
        )

    def status_line(self) -> str:
        """View size, calls and lag, one line (logged every ``status_log_s``)."""
        return self._snapshot().summary()

    async def stats(self) -> AgentStats:
        return self._snapshot()

    def _snapshot(self) -> AgentStats:
        view, state = self.state.view, self.state
        p50, p99 = state.lag_percentiles()
        return AgentStats(
            node_id=self.node_id,
            window_ms=self.window_s * 1000.0,
            view_keys=view.known_keys(),
            view_bytes=view.table.nbytes,
            local_keys=view.local_keys(),
            lookups=self.lookups,
            keys_asked=self.keys_asked,
            shard_calls=dict(self.calls),
            feed_entries=state.feed_entries,
            gaps=state.gaps,
            resets=view.resets,
            lag_p50_s=p50,
            lag_p99_s=p99,
            started_at=self.started_at,
            holder_changes=self.changes,
            view_scope="all" if view.complete else "filling" if view.all_keys else "asked",
            view_shared=self.writer.published,
        )

    async def ping(self) -> bool:
        return True

    async def ready(self) -> bool:
        """Once the feeds are followed (a second at most): whether the view is complete
        (``agent_view_all_keys``: every holder's keys read)."""
        await self._started()
        return self.state.view.complete

    async def close(self) -> None:
        """Remove the shared view (before ``ray.kill``: engines then ask nobody)."""
        self.writer.close()


async def _beat(writer: ViewWriter) -> None:
    """The view's heartbeat, for as long as the agent lives."""
    while True:
        writer.beat()
        await asyncio.sleep(BEAT_S)


def start_agent(
    namespace: str,
    node_id: str,
    shards: list[ActorHandle],
    window_ms: float,
    max_keys: int,
    pinned: bool = True,
    all_keys: bool = False,
) -> ActorHandle:
    """The directory agent of ``node_id`` (started, pinned to it, when missing;
    ``pinned=False``: wherever Ray places it, for simulated nodes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_cls = cast("ActorClass[object]", DirectoryAgent)  # what @ray.remote made it
    where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)} if pinned else {}
    handle = remote_cls.options(
        name=naming.directory_agent(node_id),
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        **where,
    ).remote(namespace, node_id, shards, window_ms, max_keys, all_keys)
    assert isinstance(handle, ActorHandle)  # Ray's stubs also allow the class itself
    return handle
