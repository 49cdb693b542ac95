"""Calls to an actor that Ray may be restarting after a crash (``max_restarts=-1``).

While such an actor comes back, Ray answers a call made to it, or in flight at the
crash, with ``ActorUnavailableError`` ("the task may or may not have been executed").
These helpers call again until it answers, for calls that are the same made twice
(reads, and writes that name what they set). Any other error is raised at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import ray

_T = TypeVar("_T")

#: How long a restart may take before the caller gets the error (a restart on a busy
#: 2-core host takes 1-3 s: a new worker process that imports raykv).
RESTART_WAIT_S = 30.0
_RETRY_S = 0.1


def get_riding_out_restart(
    call: Callable[[], ray.ObjectRef[_T]], timeout: float | None = None, restart_wait_s: float = RESTART_WAIT_S
) -> _T:
    """``ray.get(call())``, made again while the actor restarts; ``timeout`` bounds each try."""
    deadline = time.monotonic() + restart_wait_s
    while True:
        try:
            return ray.get(call(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(_RETRY_S)


async def await_riding_out_restart(call: Callable[[], ray.ObjectRef[_T]], restart_wait_s: float = RESTART_WAIT_S) -> _T:
    """``await call()``, made again while the actor restarts (from an async actor)."""
    deadline = time.monotonic() + restart_wait_s
    while True:
        try:
            return await call()
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(_RETRY_S)
