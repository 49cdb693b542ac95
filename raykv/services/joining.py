"""Concurrent ``raykv start`` calls in one namespace: each joins the one control actor,
and a failed first start stops only a raykv no other start joined.

Each start passes a token of its own; the control actor records the token of the
start that created it and of each start that joined it (``ControlActor.join``). A
first start whose tiers then fail stops what it started only when no other start
joined meanwhile (``ControlActor.close_if_alone``); otherwise it leaves the services
running for the others. A start that joins while the first one stops is told
CLOSING: it waits for the stop to end, then starts raykv afresh.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from raykv.config.options import RaykvConfig
from raykv.core import naming
from raykv.core.errors import RaykvError
from raykv.core.named import find_actor, named_actor
from raykv.core.restarting import get_riding_out_restart
from raykv.services.control import STOPPING_S, ControlActor
from raykv.services.messages import StartRole
from raykv.services.rules_store import clear_stopping, stopping_until

logger = logging.getLogger(__name__)

_POLL_S = 0.1
#: Control actors found dead in a row before the error is the start's (a constructor
#: that fails fails again; a stop's kill happens once).
_DIED_TRIES = 3


@dataclass(frozen=True)
class Joined:
    """A start's place in its namespace's raykv."""

    namespace: str
    control: ActorHandle
    #: This start's own token (``ControlActor.join``).
    token: str
    #: Whether this start created the control actor (the namespace's first start).
    first: bool


def join_control(config: RaykvConfig) -> Joined:
    """Join (or create) ``config.namespace``'s control actor, waiting out the stop of a
    failed first start (at most ``STOPPING_S``; then a ``RaykvError``)."""
    ns, token = config.namespace, uuid.uuid4().hex
    deadline, died = time.monotonic() + STOPPING_S + 10.0, 0
    while True:
        # Created with no tiers: each start lists the tiers it started (``add_tiers``), so
        # the config never names a tier whose start failed.
        control = named_actor(ControlActor, naming.CONTROL_ACTOR, ns, dataclasses.replace(config, tiers=[]), token)
        try:
            role: StartRole = get_riding_out_restart(lambda: control.join.remote(token))
        except ray.exceptions.RayActorError:  # killed by a stop, or its constructor failed
            died += 1
            if died > _DIED_TRIES:
                raise
            _wait_for_stop(control, ns, deadline)
            continue
        if role is not StartRole.CLOSING:
            return Joined(ns, control, token, role is StartRole.FIRST)
        if time.monotonic() > deadline:
            raise RaykvError(
                f"raykv in namespace {ns!r} is still being stopped by a start that failed: "
                f"`raykv stop --namespace {ns}`, then `raykv start` again"
            )
        logger.warning("a raykv start in namespace %r failed and stops what it started: starting again after it", ns)
        _wait_for_stop(control, ns, deadline)


def _wait_for_stop(control: ActorHandle, namespace: str, deadline: float) -> None:
    """Until ``control`` is gone and the stop that killed it has ended (its GCS note is
    cleared or expired), or ``deadline`` (``time.monotonic()``) passes."""
    while time.monotonic() < deadline:
        if find_actor(naming.CONTROL_ACTOR, namespace) != control:
            until = stopping_until(namespace)
            if until is None or time.time() > until:
                return
        time.sleep(_POLL_S)


def may_stop_after_failure(joined: Joined) -> bool:
    """Whether a start that failed may stop what it started: it was the first, and no
    other start joined (they are told CLOSING from now on). Call ``stop_done`` after."""
    if not joined.first:
        return False
    try:
        alone = bool(get_riding_out_restart(lambda: joined.control.close_if_alone.remote(joined.token), timeout=10))
    except Exception as e:  # the control actor gone or unreachable: leave what runs
        logger.warning("raykv start failed; could not ask its control actor whether to stop it: %r", e)
        return False
    if not alone:
        logger.warning(
            "raykv start failed; another start joined namespace %r meanwhile: its services keep running",
            joined.namespace,
        )
    return alone


def stop_done(namespace: str) -> None:
    """The failed first start has stopped what it started: other starts may start raykv."""
    clear_stopping(namespace)
