"""An engine's own KV cache, in raykv's directory: vLLM's KV events, forwarded.

vLLM publishes the blocks its KV cache manager stores and removes when
``kv_events_config`` is on (``enable_kv_cache_events``, publisher ``zmq``).
``EngineEventsBridge`` subscribes to that publisher from inside the engine
process (``inproc://`` endpoints work: vLLM binds on ZeroMQ's process-wide
context) on a thread of its own, folds each step's events, and sends them to
the engine's ``EngineCacheActor`` in one actor call at a time (events that
arrive meanwhile wait for the next call). The scheduler thread does nothing
more than vLLM already does to publish.

The engine's Serve replica (``owner``) comes from ``RAYKV_ENGINE_OWNER``, which
raykv's vLLM plugin sets in the replica's process before vLLM spawns the engine
(``raykv.integrations.vllm.plugin``); routers match it with the replica's actor.

Supported: vLLM 0.32 (``tests/integrations/vllm/test_kv_events.py`` in CI) and 0.33
(``vllm.distributed.kv_events``: the same fields); on 0.29 the test passed run alone but
failed once in the matrix run, so 0.29 is not claimed yet.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import ray
from ray.actor import ActorClass, ActorHandle

from raykv.core.named import raykv_running
from raykv.core.naming import OWNER_ENV
from raykv.core.node import process_node_id, ray_session
from raykv.core.outcomes import CallOutcome
from raykv.holders import engine_cache

if TYPE_CHECKING:
    from vllm.config.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

#: Media of the engine's own cache in vLLM's events (offloading tiers report CPU, DISK...).
ENGINE_MEDIA = (None, "GPU", "gpu")
#: How long ``replace_actor`` tries to start the new actor under the old one's name.
SWAP_TIMEOUT_S = 10.0
#: While the actor is gone, how often the thread checks whether raykv runs (then it starts a new one).
REVIVE_EVERY_S = 2.0


def connect_endpoint(kv_events_config: KVEventsConfig | None) -> str | None:
    """Where to subscribe to the engine's KV events (None: not published over ZeroMQ)."""
    if kv_events_config is None or not getattr(kv_events_config, "enable_kv_cache_events", False):
        return None
    if getattr(kv_events_config, "publisher", None) != "zmq":
        return None
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint = ZmqEventPublisher.offset_endpoint_port(kv_events_config.endpoint, 0)
    if endpoint and endpoint.startswith("tcp://"):
        endpoint = endpoint.replace("*", "127.0.0.1").replace("[::]", "[::1]")
    return endpoint


class EngineEventsBridge:
    """vLLM's KV events of this engine process -> its ``EngineCacheActor``."""

    #: One bridge per (namespace, endpoint) in a process (every raykv tier of the engine asks).
    _running: dict[tuple[str, str], "EngineEventsBridge"] = {}
    _lock = threading.Lock()

    @classmethod
    def start_for(cls, namespace: str, endpoint: str, topic: str, tag: bytes) -> "EngineEventsBridge":
        with cls._lock:
            bridge = cls._running.get((namespace, endpoint))
            if bridge is None:
                bridge = cls._running[(namespace, endpoint)] = cls(namespace, endpoint, topic, tag)
            return bridge

    def __init__(self, namespace: str, endpoint: str, topic: str, tag: bytes) -> None:
        self.namespace = namespace
        self.endpoint = endpoint
        self.topic = topic
        self.tag = tag
        node_id = process_node_id()  # the replica's node, also on a simulated cluster
        self.info = engine_cache.holder_info(namespace, node_id, os.environ.get(OWNER_ENV) or None)
        self._node_id = node_id
        self.actor: ActorHandle = self._start_actor()
        #: Set by ``replace_actor``: the thread starts a new actor before its next batch.
        self._replace = threading.Event()
        self._actor_gone = False  # its calls fail for good: batches are dropped until replaced
        self._next_revive = 0.0
        self.batches = 0
        self.errors = 0
        self._parent = os.getppid()
        self._load_counters: dict[str, Callable[[], int]] = {}  # the process that started the engine (a Serve replica)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)  # subscribed (inproc: before vLLM publishes its first step)
        logger.info(
            "raykv: engine KV events from %s -> %s (replica %s)", endpoint, self.info.actor_name, self.info.owner
        )

    def _start_actor(self) -> ActorHandle:
        """This engine's ``EngineCacheActor``. Owned by this process (not detached): it dies
        with the engine, and the directory, which watches it, drops the engine's blocks at once."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # mypy does not apply class decorators: @ray.remote made the class an ActorClass.
        actor_class = cast("ActorClass[engine_cache.EngineCacheActor]", engine_cache.EngineCacheActor)
        actor = actor_class.options(
            name=self.info.actor_name,
            namespace=self.namespace,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=True),
        ).remote(self.info, self.namespace)
        assert isinstance(actor, ActorHandle)  # Ray's stubs also allow the class itself
        return actor

    def replace_actor(self) -> None:
        """After raykv was stopped and started again: record the engine's cache in a new
        actor at the new directory (from the next batch on; blocks cached before are not
        listed again until the engine stores them anew). Never blocks; each raykv tier of
        the engine asks once per restart, and an actor that answers is kept."""
        self._replace.set()

    def _swap_actor(self) -> None:
        """On the bridge's thread: unless the current actor answers (another tier asked
        first), kill it and start its successor under the same name (freed shortly after
        the kill: tried for ``SWAP_TIMEOUT_S``)."""
        self._replace.clear()
        try:
            ray.get(self.actor.raykv_ping.remote(), timeout=SWAP_TIMEOUT_S)
            return  # alive: already the restarted raykv's
        except Exception:  # noqa: BLE001 - dead (raykv stop kills it) or unreachable: replace it
            pass
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already dead (raykv stop kills it)
            pass
        deadline = time.monotonic() + SWAP_TIMEOUT_S
        while True:
            try:
                self.actor = self._start_actor()
                break
            except ValueError as e:  # the name is still the old actor's
                if time.monotonic() > deadline:
                    logger.warning("raykv: no new engine cache actor: %r", e)
                    return
                time.sleep(0.2)
        self._actor_gone = False
        logger.info("raykv: engine KV events now go to a new %s", self.info.actor_name)

    def _revive_if_running(self) -> None:
        """The actor died for good (``ray.kill``, an OOM kill): start a new one if raykv runs
        (its control actor lives). After ``raykv stop`` the tier's reattach asks instead,
        once raykv is started again. A GCS lookup every ``REVIVE_EVERY_S`` at most."""
        if time.monotonic() < self._next_revive:
            return
        self._next_revive = time.monotonic() + REVIVE_EVERY_S
        try:
            running = raykv_running(self.namespace)
        except Exception:  # noqa: BLE001 - the GCS busy: ask again later
            return
        if running:
            logger.warning(
                "raykv: the engine cache actor %s died while raykv runs: starting it again", self.info.actor_name
            )
            self._replace.set()

    def count_loads(self, tier: str, blocks_loaded: Callable[[], int]) -> None:
        """Report this engine's blocks loaded from raykv tier ``tier`` with its
        events (``raykv status`` shows each engine's hits by source)."""
        self._load_counters[tier] = blocks_loaded

    def _loads(self) -> dict[str, int]:
        out = {}
        for tier, count in list(self._load_counters.items()):
            try:
                out[tier] = int(count())
            except Exception:  # noqa: BLE001 - a figure for status pages only
                continue
        return out

    # -- the thread ------------------------------------------------------------
    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        self._ready.set()
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        stored: dict[bytes, None] = {}
        removed: set[bytes] = set()
        cleared = False
        inflight: CallOutcome | None = None
        session = ray_session()
        try:
            while not self._stop.is_set():
                if ray_session() != session:  # Ray shut down in this process: nothing to send to
                    return
                if os.getppid() != self._parent:
                    # The replica that started this engine died and left it running:
                    # nobody can route to it any more, so its blocks leave the directory.
                    logger.warning("raykv: the engine's parent process is gone; dropping its engine-cache entries")
                    ray.kill(self.actor)
                    return
                if sub.poll(20):
                    while True:
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            batch = decode(frames[-1])
                        except Exception:  # noqa: BLE001 - a frame we cannot read costs routing accuracy only
                            self.errors += 1
                            continue
                        cleared = self._fold(batch.events, stored, removed) or cleared
                if inflight is not None:
                    done, _, error = inflight.poll()
                    if not done:
                        continue
                    if error is not None:  # the engine serves on; the directory just lags
                        self.errors += 1
                        if not self._actor_gone:
                            logger.warning("raykv: engine cache actor call failed: %s", error)
                        self._actor_gone = isinstance(error, ray.exceptions.ActorDiedError)
                    inflight = None
                if self._actor_gone and not self._replace.is_set():
                    self._revive_if_running()
                if self._replace.is_set():
                    self._swap_actor()
                if self._actor_gone:  # raykv stopped: nobody to tell until it runs again
                    stored, removed, cleared = {}, set(), False
                    continue
                if stored or removed or cleared:
                    inflight = CallOutcome(self.actor.apply.remote(list(stored), list(removed), cleared, self._loads()))
                    self.batches += 1
                    stored, removed, cleared = {}, set(), False
        finally:
            sub.close(0)

    def _fold(self, events: Sequence[object], stored: dict[bytes, None], removed: set[bytes]) -> bool:
        """Fold one step's events into the pending sets, in order; True when the cache was cleared."""
        cleared = False
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                stored.clear()
                removed.clear()
                cleared = True
                continue
            if getattr(event, "medium", None) not in ENGINE_MEDIA:
                continue
            keys = engine_cache.engine_keys(self.tag, getattr(event, "block_hashes", None) or ())
            if kind == "BlockStored":
                for k in keys:
                    removed.discard(k)
                    stored[k] = None
            elif kind == "BlockRemoved":
                for k in keys:
                    stored.pop(k, None)
                    removed.add(k)
        return cleared

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop forwarding and drop the engine's entries now (a clean engine shutdown)."""
        self._stop.set()
        self._thread.join(timeout_s)
        with self._lock:
            self._running.pop((self.namespace, self.endpoint), None)
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - Ray already gone at interpreter exit
            pass
