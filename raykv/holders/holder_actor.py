"""The base of every tier's holder actor: all of it but the storage.

A holder actor owns a tier's blocks somewhere (this node's plasma, a shared
root) and keeps the directory told. ``HolderActor`` does the part every tier
shares:

- start-up (a task every method awaits, ``_started``): find the control actor
  and the directory shards, announce the holder to both (a holder whose blocks
  die with it first drops what its previous life registered), then let the
  tier ``recover`` (scan its storage and register what is there);
- be watched (``raykv_watch``: the directory learns of its death when that call
  errors), answer ``raykv_resync`` for a rebuilding shard, and reconcile its
  per-shard key counts with the directory every ``holder_reconcile_s``;
- register / unregister keys (``_register``, ``_unregister``: failures are
  counted, never raised: a shard rebuilds from holders);
- the holdings log behind engines' KV events (``events_since``), metrics
  (``_publish``), the live status line, ``ready`` and ``keys``.

A tier's actor subclasses it (``@ray.remote``) and writes only its data path:
``held_keys``, ``occupancy``, ``status_line``, ``describe`` and, when it has
storage that outlives it, ``recover``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import numpy as np
import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import ActorDiedError

from raykv.core import naming
from raykv.core.identity import blocks_by_identity
from raykv.core.keys import shard_of
from raykv.core.named import successor
from raykv.core.restarting import await_riding_out_restart
from raykv.core.tenants import TenantLRU
from raykv.core.wire import HolderInfo, HolderReady, HoldingsPage, Report
from raykv.directory.agent import start_agent
from raykv.directory.client import AgentClient, DirectoryClient, shard_ids
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.replaced import while_running
from raykv.holders.events import HoldingsLog
from raykv.holders.messages import HolderStats
from raykv.metrics import status_log
from raykv.metrics.recorders import PIN_REFUSAL_COUNTERS, ActorMetrics, CounterName

logger = logging.getLogger(__name__)


_R = TypeVar("_R")
_P = ParamSpec("_P")


def runs_to_end(method: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]:
    """An actor method that runs to its end even when its caller dies mid-call.

    Ray cancels a dead caller's tasks; a method that updates the actor's index
    and the directory in several awaits must not stop between them, or the
    two would disagree."""

    @functools.wraps(method)
    async def shielded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await asyncio.shield(method(*args, **kwargs))

    return shielded


async def settle(refs: Iterable[Awaitable[object]], what: str = "directory call") -> int:
    """Await actor calls (a holder's directory updates); log failures, count them.

    A directory shard that dies mid-call restarts and rebuilds its entries
    from the holders (``raykv_resync``), so a failed update is not lost and
    must not fail the holder's own operation.
    """
    failed = 0
    for r in await asyncio.gather(*refs, return_exceptions=True):
        if isinstance(r, BaseException):
            failed += 1
            logger.warning("%s failed (the shard rebuilds from holders): %r", what, r)
    return failed


class WatchableActor:
    """What the directory needs of any holder: ``raykv_watch`` (its death is
    seen when that call errors), ``raykv_resync`` for a rebuilding shard, and
    reconciling key counts. ``HolderActor`` builds on it; test and benchmark
    holders use it alone."""

    async def raykv_watch(self) -> None:
        """Never returns; the caller learns of this actor's death when it errors."""
        await asyncio.Event().wait()

    async def raykv_ping(self) -> bool:
        return True

    def raykv_holdings(self) -> tuple[HolderInfo, list[bytes]]:
        """This holder's ``HolderInfo`` and every key it holds now (override).

        Must answer at once, even while the actor is still starting: a
        restarting directory shard calls it (``raykv_resync``) and the actor's
        own start-up may be waiting on that shard.
        """
        raise NotImplementedError

    async def raykv_resync(self, shard: int, num_shards: int) -> tuple[HolderInfo, list[bytes]]:
        """For a (re)started directory shard: our holder info and our keys of that shard."""
        info, keys = self.raykv_holdings()
        return info, _keys_of_shard(keys, shard, num_shards)

    def start_reconciling(self, directory: DirectoryClient, period_s: float) -> asyncio.Task[None] | None:
        """Repair drift between this holder and the directory every ``period_s``.

        The directory learns a holder's keys from its register / unregister
        calls, a rebuild and a watch. Each can be lost without the holder
        dying (a call failed while a shard restarted, a rebuild timed out, a
        watch errored under load); the entries then stay wrong until the holder
        restarts. So the holder compares its own key count per shard with the
        shard's, and a shard that differs twice in a row (a single difference
        may be calls in flight) gets the holder's full listing (``sync_holder``).
        """
        if period_s <= 0:
            return None
        return asyncio.get_running_loop().create_task(self._reconcile(directory, period_s))

    async def _reconcile(self, directory: DirectoryClient, period_s: float) -> None:
        me = ray.get_runtime_context().current_actor
        suspect: set[int] = set()
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._reconcile_once(directory, me, suspect)
            except Exception as e:  # best effort: try again next period
                logger.debug("directory reconcile failed: %r", e)

    async def _reconcile_once(self, directory: DirectoryClient, me: ActorHandle, suspect: set[int]) -> int:
        """One round; returns how many shards were sent a full listing."""
        n = directory.num_shards
        info, keys = self.raykv_holdings()
        mine = _per_shard_counts(keys, n)
        counts = await asyncio.gather(
            *(s.holder_counts.remote(info.holder_id) for s in directory.shards), return_exceptions=True
        )
        repaired = 0
        for i, listed in enumerate(counts):
            if isinstance(listed, BaseException):
                # A restarting shard rebuilds from us anyway; one killed for good and started
                # again is a new actor, which our handle never reaches: take its handle and
                # list our keys to it now (its rebuild may have run before they existed).
                if not (isinstance(listed, ActorDiedError) and await asyncio.to_thread(directory.replace_dead, i)):
                    continue
            elif listed == mine[i]:
                suspect.discard(i)
                continue
            elif i not in suspect:
                suspect.add(i)
                continue
            # Snapshot and send with no await in between: later register /
            # unregister calls of ours reach the shard after this listing.
            info, keys = self.raykv_holdings()
            part = _keys_of_shard(keys, i, n)
            listing = to_blob(fingerprints(part))
            ref: ray.ObjectRef[tuple[int, int]] = directory.shards[i].sync_holder.remote(info, me, listing)
            suspect.discard(i)
            await ref
            repaired += 1
        return repaired


class HolderActor(WatchableActor):
    """Base of holder actors (see the module docstring). Subclasses call
    ``super().__init__`` first: the start-up task and the status log it
    creates run once the subclass's ``__init__`` has returned, and never
    when it raises (``__init_subclass__``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def init_or_abandon(self: HolderActor, *args: Any, **kw: Any) -> None:
            # An actor whose __init__ raised is dead, but its event loop may still run the
            # start-up task for a moment: it would announce the holder and start the node's
            # directory agent after its starter gave up (and after a failed start's cleanup).
            try:
                init(self, *args, **kw)
            except BaseException:
                self._abandon_start()
                raise

        cls.__init__ = init_or_abandon  # type: ignore[method-assign]

    def _abandon_start(self) -> None:
        for task in (self.__dict__.get("_started"), self.__dict__.get("_status_log")):
            if task is not None:
                task.cancel()

    #: Whether the holder's blocks die with the actor (plasma objects): a
    #: restarted actor then first unregisters what its previous life held.
    BLOCKS_DIE_WITH_ACTOR = True

    #: The capacity its starter asked for (bytes; 0: unlimited): each subclass sets it in ``__init__``.
    requested_capacity: int
    #: Set by the start-up task, which every method awaits first.
    _directory: DirectoryClient
    #: Where ``_register``/``_unregister`` go: the node's directory agent (merged into
    #: its windows) when ``directory_agent`` is on, else straight to the shards.
    _writes: DirectoryClient | AgentClient
    _control: ActorHandle

    def __init__(self, info: HolderInfo, namespace: str, counter_names: Mapping[str, CounterName]) -> None:
        self.info = info
        self.namespace = namespace
        self.counters: Counter[str] = Counter()
        self.log = HoldingsLog()
        self.started_at = time.time()
        self._metrics = ActorMetrics(
            info.tier_type,
            info.node_id,
            info.holder_id,
            {**PIN_REFUSAL_COUNTERS, **counter_names},
            pins=lambda: self.pin_table(),
        )
        # Async actors run __init__ on their event loop: the start-up is a task
        # that every method waits for.
        self._started = asyncio.get_running_loop().create_task(self._start())
        self._status_log = status_log.spawn(self.status_line, namespace=namespace)

    # -- what a tier writes ----------------------------------------------
    def held_keys(self) -> list[bytes]:
        """Every key held now (least recently used first where the tier keeps an order)."""
        raise NotImplementedError

    def occupancy(self) -> tuple[int, int, int]:
        """(blocks, bytes, capacity in bytes; 0: unlimited) for the metrics."""
        raise NotImplementedError

    def status_line(self) -> str:
        """Live occupancy and traffic, one line (logged every ``status_log_s``)."""
        raise NotImplementedError

    def describe(self) -> Report:
        """What ``ready`` reports besides the holder and its capacity (where, how)."""
        return {}

    def pin_table(self) -> TenantLRU | None:
        """The tier's tenants and pinned keys, for the pin gauges (None: this tier keeps no pins)."""
        return None

    async def recover(self) -> None:
        """After announcing: take in blocks that outlived a previous actor (scan storage)."""

    # -- start-up ----------------------------------------------------------
    async def _start(self) -> None:
        control = ray.get_actor(naming.CONTROL_ACTOR, namespace=self.namespace)
        # The namespace's RaykvConfig (a room holders does not import).
        config: Any = await await_riding_out_restart(control.config.remote)
        shards = [
            ray.get_actor(naming.directory_shard(i), namespace=self.namespace) for i in range(config.directory_shards)
        ]
        self._directory = DirectoryClient(shards, self.namespace)
        self._writes = self._directory
        if getattr(config, "directory_agent", False):
            node_id = ray.get_runtime_context().get_node_id()
            agent = functools.partial(
                start_agent,
                self.namespace,
                node_id,
                self._directory.shards,
                config.agent_window_ms,
                config.agent_view_keys,
                all_keys=config.agent_view_all_keys,
            )
            self._writes = AgentClient(agent(), len(shards), restart=while_running(self.namespace, agent))
        self._control = control
        self._reconciler = self.start_reconciling(self._directory, float(config.holder_reconcile_s))
        me = ray.get_runtime_context().current_actor
        if self.BLOCKS_DIE_WITH_ACTOR:
            await settle(self._directory.remove_holder(self.info.holder_id, "restarted"))
        await settle([*self._directory.add_holder(self.info, me), control.add_holder.remote(self.info, me)])
        await self.recover()
        self._publish()

    async def _reconcile_once(self, directory: DirectoryClient, me: ActorHandle, suspect: set[int]) -> int:
        """Also announce ourselves again to a control actor that forgot us."""
        try:
            await self._announce(me)
        except Exception as e:  # noqa: BLE001 - the directory's repair does not need the control actor
            logger.debug("announcing to the control actor failed: %r", e)
        return await super()._reconcile_once(directory, me, suspect)

    async def _announce(self, me: ActorHandle) -> None:
        """Announce ourselves to the control actor if it does not list us: it restarted
        with an empty holder list, or it was killed for good and ``raykv start`` started
        another under its name (we call that one from then on)."""
        try:
            known: list[HolderInfo] = await self._control.holders.remote()
        except ActorDiedError:
            live = await asyncio.to_thread(successor, self._control, naming.CONTROL_ACTOR, self.namespace)
            if live is None:
                raise
            logger.info("raykv's control actor was started again as a new actor: announcing %s to it", self.info)
            self._control = live
            known = await live.holders.remote()
        if self.info.holder_id not in {h.holder_id for h in known}:
            await self._control.add_holder.remote(self.info, me)

    # -- helpers for tiers -------------------------------------------------
    def _publish(self) -> None:
        """Occupancy and counters to Ray's metrics (local, no remote call)."""
        self._metrics.record(*self.occupancy(), self.counters)

    def _register(self, keys: Sequence[bytes]) -> Awaitable[None]:
        """Tell the directory we hold ``keys``. The calls leave now, before any
        other coroutine of this actor runs (so index and directory change
        together); await the result to count failures."""
        return self._settled(self._writes.register(self.info.holder_id, keys) if keys else [])

    def _unregister(self, keys: Sequence[bytes]) -> Awaitable[None]:
        """Tell the directory we no longer hold ``keys`` (sent now, like ``_register``)."""
        return self._settled(self._writes.unregister(self.info.holder_id, keys) if keys else [])

    async def _settled(self, refs: list[ray.ObjectRef[int]]) -> None:
        self.counters["directory_errors"] += await settle(refs)

    # -- API -----------------------------------------------------------------
    async def ready(self) -> HolderReady:
        """Once started: the holder, its capacity (and the one asked for) and ``describe()``."""
        await self._started
        return HolderReady(
            holder=self.info,
            capacity_bytes=self.occupancy()[2],
            requested_capacity_bytes=self.requested_capacity,
            details=self.describe(),
            settings=self.started_with(),
        )

    def started_with(self) -> object | None:
        """The settings it was started with (its tier's frozen dataclass; None: the tier has
        none): ``ready()`` reports them, and a starter that asked for others hears which differ."""
        return None

    def tier_stats(self) -> Report:
        """The tier's own figures for ``stats`` (override)."""
        return {}

    async def stats(self) -> HolderStats:
        """Blocks per KV identity and the tier's figures (``raykv status``, tools)."""
        await self._started
        return HolderStats(
            holder_id=self.info.holder_id,
            started_at=self.started_at,
            blocks_by_identity=blocks_by_identity(self.held_keys()),
            figures=self.tier_stats(),
        )

    async def keys(self) -> list[bytes]:
        """Held keys (tools and tests)."""
        await self._started
        return self.held_keys()

    async def events_since(self, since: int | None, tag: bytes) -> HoldingsPage:
        """Blocks of identity ``tag`` stored / removed since ``since`` (``raykv.holders.events``)."""
        await self._started
        return self.log.read(since, tag, self.held_keys)

    def raykv_holdings(self) -> tuple[HolderInfo, list[bytes]]:
        return self.info, self.held_keys()


def _keys_of_shard(keys: list[bytes], shard: int, num_shards: int) -> list[bytes]:
    """The ones of ``keys`` that directory shard ``shard`` owns."""
    return [k for k in keys if shard_of(k, num_shards) == shard]


def _per_shard_counts(keys: list[bytes], num_shards: int) -> list[int]:
    """How many of ``keys`` each directory shard owns."""
    ids = shard_ids(keys, num_shards) if keys else None
    if ids is None:
        ids = np.fromiter((shard_of(k, num_shards) for k in keys), dtype=np.int64, count=len(keys))
    return np.bincount(ids.astype(np.int64, copy=False), minlength=num_shards).tolist()


def process_holder_info(
    tier_type: str, medium: str, namespace: str, node_id: str, owner: str | None, pid: int | None = None
) -> HolderInfo:
    """The holder of what one engine process ``pid`` (default: this one) lists itself
    (its own cache, its pending entries): named by its kind, node and pid."""
    pid = os.getpid() if pid is None else pid
    name = f"raykv-{tier_type}-{node_id[:12]}-{pid}"
    return HolderInfo(f"{tier_type}:{node_id}:{pid}", tier_type, medium, name, namespace, node_id, owner)


def start_on_node(actor_cls: type, name: str, node_id: str, namespace: str, *args: object) -> ActorHandle:
    """Start (or find) the detached holder actor ``name`` (a ``@ray.remote`` class)
    pinned to ``node_id``; returns its handle."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_cls = cast("ActorClass[object]", actor_cls)  # what @ray.remote made it (mypy ignores class decorators)
    handle = remote_cls.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(*args)
    assert isinstance(handle, ActorHandle)  # Ray's stubs also allow the class itself
    return handle
