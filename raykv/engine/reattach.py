"""An engine's raykv tiers outlive ``raykv stop``; after ``raykv start`` they attach again.

``raykv stop`` kills every raykv actor for good, while the engines keep running:
their tiers then miss and their stores fail fast, so requests are computed as
without raykv. When raykv is started again the engine process notices it
(``RaykvServices.restarted``, from the policy cache's long poll: no call on the
scheduler thread) and ``TierReattach`` builds a fresh tier from the same config
in a background thread, exactly as at engine start. The caller swaps it in and
retires the old one: its jobs in flight still end in one result each.

The same happens, with the same services, when the tier's own actor (a node's
object store actor, an fs root actor) was killed for good while raykv runs
(``ray.kill`` without restart; its ``ActorLiveness`` reports it ``gone``): the
new tier starts its successor, or finds the one ``raykv start`` started, as at
engine start. Without this the engine would miss on that tier until it restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from raykv.core.contract import JobResult, SecondaryTier

logger = logging.getLogger(__name__)

#: After a failed attempt to build the new tier, wait this long before the next.
RETRY_AFTER_S = 10.0
#: A retired tier whose jobs have not all ended by then is shut down anyway
#: (its ``shutdown`` fails what is left, so each still gets its result).
RETIRE_AFTER_S = 30.0

#: Why a tier is built anew (for logs).
RAYKV_RESTARTED = "raykv was stopped and started again"
ACTOR_KILLED = "its actor was killed for good"


def restarted(tier: SecondaryTier) -> bool:
    """Whether ``tier``'s raykv services were stopped and raykv runs again (never blocks)."""
    services = getattr(tier, "services", None)
    return bool(getattr(services, "restarted", False))


def actor_gone(tier: SecondaryTier) -> bool:
    """Whether ``tier``'s actor was killed for good while raykv runs (never blocks)."""
    liveness = getattr(tier, "liveness", None)
    return bool(getattr(liveness, "gone", False))


class TierReattach:
    """Builds the replacement of one tier (``make``) once its services restarted or its
    actor was killed for good; keeps the tiers it replaced until their jobs have ended."""

    def __init__(self, make: Callable[[], SecondaryTier], what: str) -> None:
        self._make = make
        self.what = what  # for logs: "object_store tier"
        self._thread: threading.Thread | None = None
        self._made: SecondaryTier | None = None
        self._not_before = 0.0
        self._retired: list[_Retired] = []
        #: Times this tier attached to a restarted raykv.
        self.reattached = 0
        #: Times it was built anew because its actor was killed for good.
        self.actor_replaced = 0
        self._why = ""

    def poll(self, tier: SecondaryTier) -> SecondaryTier | None:
        """The new tier to use instead of ``tier`` once it is built, else None.
        Cheap when nothing happened: two attribute reads."""
        if self._thread is None:
            if time.monotonic() < self._not_before:
                return None
            if restarted(tier):
                services = getattr(tier, "services", None)
                if services is not None:  # the build's ``attach`` must find the new services
                    services.retire()
                self._start_build(RAYKV_RESTARTED)
            elif actor_gone(tier):
                self._start_build(ACTOR_KILLED)
            return None
        if self._thread.is_alive():
            return None
        self._thread = None
        made, self._made = self._made, None
        if made is None:
            self._not_before = time.monotonic() + RETRY_AFTER_S
            return None
        self._retired.append(_Retired(tier))
        if self._why == ACTOR_KILLED:
            self.actor_replaced += 1
        else:
            self.reattached += 1
        logger.warning(
            "raykv: the %s was built anew (%s) in %.1f s", self.what, self._why, time.monotonic() - self._started
        )
        return made

    def _start_build(self, why: str) -> None:
        self._why = why
        self._thread = threading.Thread(target=self._build, name="raykv-reattach", daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _build(self) -> None:
        try:
            self._made = self._make()
        except Exception as e:  # noqa: BLE001 - the old tier keeps missing; try again later
            logger.warning("raykv: the %s could not be built anew (%s): %r", self.what, self._why, e)

    # -- retired tiers -----------------------------------------------------------
    def finished_jobs(self) -> Iterable[JobResult]:
        """Results of the retired tiers' jobs; a tier goes once it is shut down and
        its last results (the jobs its shutdown failed) are taken."""
        out: list[JobResult] = []
        for r in list(self._retired):
            if r.closing is None:
                out.extend(r.tier.get_finished_jobs())
                r.close_when_idle()
            elif not r.closing.is_alive():  # (never polled while its shutdown runs)
                out.extend(r.tier.get_finished_jobs())
                self._retired.remove(r)
        return out

    def has_pending_work(self) -> bool:
        return bool(self._retired)

    def shutdown(self) -> None:
        for r in self._retired:
            r.tier.shutdown()
        self._retired.clear()


class _Retired:
    """A replaced tier, shut down (off the caller's thread) once its jobs ended or after ``RETIRE_AFTER_S``."""

    def __init__(self, tier: SecondaryTier) -> None:
        self.tier = tier
        self.since = time.monotonic()
        self.closing: threading.Thread | None = None

    def close_when_idle(self) -> None:
        if self.tier.has_pending_work() and time.monotonic() - self.since < RETIRE_AFTER_S:
            return
        self.closing = threading.Thread(target=self.tier.shutdown, name="raykv-retire", daemon=True)
        self.closing.start()
