"""A one-line live status each raykv actor logs periodically.

Ray records an actor's repr once, when it starts; the live figures
(occupancy, hits, lookups) go to the actor's log instead, which the Ray
dashboard shows under the actor's Logs. A line is logged at most every
``status_log_s`` seconds (``RaykvConfig``), and only when it changed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

import ray

from raykv.core import naming
from raykv.core.handles import ConfigSource

logger = logging.getLogger("raykv.ops.status")

DEFAULT_INTERVAL_S = 30.0
_handler: logging.Handler | None = None


async def _interval_from_control(namespace: str) -> float:
    """The namespace's ``status_log_s`` (the default when the control actor cannot say)."""
    try:
        control: ConfigSource = await asyncio.to_thread(ray.get_actor, naming.CONTROL_ACTOR, namespace=namespace)
        config = await asyncio.wait_for(control.config.remote(), 30)
        interval = getattr(config, "status_log_s", None)  # a RaykvConfig (a room metrics does not import)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise TypeError(f"the control actor's config() is a {type(config).__name__} without status_log_s")
        return float(interval)
    except Exception as e:
        logger.warning("status log interval unknown (%r); using %.0f s", e, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S


async def _run(line: Callable[[], str], interval_s: float | None, namespace: str | None) -> None:
    if interval_s is None:
        interval_s = await _interval_from_control(namespace or naming.DEFAULT_NAMESPACE)
    if interval_s <= 0:
        return
    last = None
    while True:
        await asyncio.sleep(interval_s)
        try:
            text = line()
        except Exception as e:  # a status line must never take the actor down
            text = f"status unavailable: {e!r}"
        if text != last:
            logger.info("%s", text)
            last = text


def _ensure_handler() -> None:
    """Ray workers log only Ray's own INFO records: give status lines their own stderr handler."""
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("%(asctime)s raykv status: %(message)s"))
        logger.addHandler(_handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def spawn(line: Callable[[], str], *, interval_s: float | None = None, namespace: str | None = None) -> asyncio.Task:
    """Log ``line()`` every ``interval_s`` seconds (when it changed) on the running event loop.

    With ``interval_s=None`` the interval is the namespace's ``status_log_s``,
    asked of the control actor. Must be called on the actor's event loop
    (async actors run ``__init__`` there).
    """
    _ensure_handler()
    return asyncio.get_running_loop().create_task(_run(line, interval_s, namespace))
