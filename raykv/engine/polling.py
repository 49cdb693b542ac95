"""Engine-side views of holder actors, polled without ever blocking the scheduler."""

from __future__ import annotations

import logging
import threading
import time
from typing import cast

import ray
from ray.exceptions import ActorDiedError

from raykv.core.contract import TierEvent
from raykv.core.handles import HolderHandle, WatchableHandle
from raykv.core.keys import OffloadKey
from raykv.core.named import killed_for_good
from raykv.core.outcomes import CallOutcome
from raykv.core.wire import HoldingsPage
from raykv.metrics.step_cost import COUNTS

logger = logging.getLogger(__name__)


class ActorLiveness:
    """An engine-side view of a ``WatchableActor``'s life, polled without blocking.

    A never-returning ``raykv_watch`` call errors when the actor dies; while it
    is dead, a ``raykv_ping`` once per ``ping_period_s`` notices Ray restarting
    it (``max_restarts``), and a new watch starts.

    Given the actor's ``name`` and ``namespace``, a ping that finds it dead for good
    (``ActorDiedError``: ``ray.kill`` without restart) has a thread check whether raykv
    still runs and the name is free or another actor's (``killed_for_good``); ``gone``
    then tells the tier's owner to build the tier anew (``raykv.engine.reattach``).
    """

    #: Least seconds between two such checks (two GCS lookups each).
    GONE_CHECK_S = 2.0

    def __init__(
        self,
        actor: WatchableHandle,
        what: str,
        ping_period_s: float = 1.0,
        name: str | None = None,
        namespace: str | None = None,
    ) -> None:
        self.actor = actor
        self.what = what  # for logs: "object store actor of node ..."
        self.ping_period_s = ping_period_s
        self.alive = True
        #: Killed for good while raykv runs: a tier built anew starts (or finds) its successor.
        self.gone = False
        self._named = (name, namespace) if name is not None and namespace is not None else None
        self._check: threading.Thread | None = None
        self._next_check = 0.0
        self._watch = CallOutcome(actor.raykv_watch.remote())
        self._ping: CallOutcome | None = None
        self._next_ping = 0.0

    def mark_dead(self, reason: str) -> None:
        """Record a death seen elsewhere (e.g. a call that raised ``RayActorError``)."""
        if self.alive:
            logger.warning("%s is gone (%s)", self.what, reason)
        self.alive = False

    def poll(self) -> None:
        """Update ``alive`` from the watch and, while dead, the pings."""
        if self.alive:
            COUNTS.polls += 1
            if self._watch.finished:
                self.mark_dead("watch ended")
            return
        if self._ping is not None:
            COUNTS.polls += 1
            done, _, error = self._ping.poll()
            if not done:
                return
            self._ping = None
            if error is not None:
                if isinstance(error, ActorDiedError):
                    self._check_gone()
                return
            self.alive = True  # restarted: it rebuilt its state and re-registered
            self.close()  # in case it was only unreachable and the old watch lives
            self._watch = CallOutcome(self.actor.raykv_watch.remote())
            logger.info("%s is back", self.what)
        elif time.monotonic() >= self._next_ping:
            self._next_ping = time.monotonic() + self.ping_period_s
            try:
                self._ping = CallOutcome(self.actor.raykv_ping.remote())
            except Exception:
                self._ping = None

    def _check_gone(self) -> None:
        """Look up, on a thread, whether the dead actor was killed for good (sets ``gone``)."""
        if self._named is None or self.gone or self._check is not None and self._check.is_alive():
            return
        if time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + self.GONE_CHECK_S
        name, namespace = self._named
        self._check = threading.Thread(target=self._look_up, args=(name, namespace), name="raykv-gone", daemon=True)
        self._check.start()

    def _look_up(self, name: str, namespace: str) -> None:
        try:
            gone = killed_for_good(self.actor, name, namespace)
        except Exception as e:  # noqa: BLE001 - the GCS busy: the next failed ping asks again
            logger.debug("%s: successor lookup failed: %r", self.what, e)
            return
        if gone:
            logger.warning("%s was killed for good: its tier attaches to the actor started under its name", self.what)
            self.gone = True

    def close(self) -> None:
        """Cancel the watch call (it would otherwise hold an actor slot forever)."""
        try:
            ray.cancel(self._watch.ref)
        except Exception:
            pass


class HoldingsFeed:
    """Reads a holder actor's ``HoldingsLog`` for one identity, one call in
    flight at a time, never blocking; results wait in ``take``."""

    #: Events kept for a caller that does not take them; past this, the
    #: oldest go and the next read is a fresh snapshot.
    MAX_KEYS = 1 << 18

    def __init__(self, actor: HolderHandle, tag: bytes) -> None:
        self.actor = actor
        self.tag = tag
        self._since: int | None = None  # None: ask for a snapshot
        self._call: CallOutcome | None = None
        self._pending: list[TierEvent] = []
        self._keys = 0
        self._strip = len(tag)

    def poll(self) -> None:
        if self._call is not None:
            COUNTS.polls += 1
            done, out, error = self._call.poll()
            if not done:
                return
            self._call = None
            if error is not None:  # the actor died or restarted: start over with a snapshot
                logger.debug("holdings feed: %r", error)
                self._since = None
                return
            if not isinstance(out, HoldingsPage):
                logger.warning("holdings feed: the holder answered %s, not a HoldingsPage", type(out).__name__)
                self._since = None
                return
            self._absorb(out)
        try:
            self._call = CallOutcome(self.actor.events_since.remote(self._since, self.tag))
        except Exception as e:
            logger.debug("holdings feed not sent: %r", e)

    def _absorb(self, page: HoldingsPage) -> None:
        n = self._strip
        if page.snapshot is not None:
            self._pending.append(TierEvent(_engine_keys(page.snapshot, n), removed=False))
            self._keys += len(page.snapshot)
        for removed, keys in page.events:
            self._pending.append(TierEvent(_engine_keys(keys, n), removed=removed))
            self._keys += len(keys)
        self._since = page.next
        while self._keys > self.MAX_KEYS and self._pending:  # nobody takes them
            self._keys -= len(self._pending.pop(0).keys)
            self._since = None

    def take(self) -> list[TierEvent]:
        out, self._pending, self._keys = self._pending, [], 0
        return out


def _engine_keys(scoped: list[bytes], strip: int) -> list[OffloadKey]:
    """The engine's own keys in ``scoped`` (their first ``strip`` bytes, the identity tag, cut)."""
    return cast("list[OffloadKey]", [k[strip:] for k in scoped])  # no call per key
