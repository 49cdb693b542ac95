"""Waiting for a Ray call's answer on a background thread, without waiting inside Ray.

``ray.get`` and ``ray.wait`` block in Ray's C++ core worker, which calls back into
Python (``check_signals``) while it waits. A thread still in there when the driver
runs ``ray.shutdown()`` is left waiting on a core worker that is gone: it can
crash the process then, at the next ``ray.init`` or while the interpreter exits
(ray-project/ray#31145, #47864; Ray 2.60 still does this). raykv's background
threads (the policy long poll, the fs control round) wait through
``ObjectRef.future()`` (Ray's public API) instead: Ray sets the future from its
own callback thread, and the waiting thread sleeps in Python, in short slices,
and gives up as soon as its Ray session ends.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TypeVar

import ray

from raykv.core.node import ray_session

_T = TypeVar("_T")

#: How often a waiting thread checks that its Ray session still runs.
SLICE_S = 0.1


class SessionEnded(RuntimeError):
    """The Ray session the call was made in ended before it answered."""


def wait_answer(ref: ray.ObjectRef[_T], timeout_s: float, session: str | None) -> _T:
    """``ray.get(ref, timeout=timeout_s)`` for a background thread of Ray session
    ``session``: the same answer and errors (``GetTimeoutError`` past the timeout;
    the call's own error), and ``SessionEnded`` once that session is over."""
    future: concurrent.futures.Future[_T] = ref.future()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(SLICE_S, left)))
        except concurrent.futures.TimeoutError:
            if ray_session() != session:
                raise SessionEnded(f"Ray session {session} ended while waiting for {ref}") from None
            if left <= 0:
                raise ray.exceptions.GetTimeoutError(f"{ref} did not answer within {timeout_s}s") from None
