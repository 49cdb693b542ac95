"""SIGTERM and SIGHUP end a ``raykv`` command the way Ctrl-C does: its clean-up runs.

``raykv demo`` and ``raykv bench`` run an embedded Ray with vLLM engines, and clean up
in ``finally`` blocks: they stop the engines (whose ``/dev/shm`` segments go with
them), the Ray processes, and their temporary folders. Python runs those blocks on
Ctrl-C (``KeyboardInterrupt``) but not on SIGHUP (a closed terminal), which kills the
process at once, nor, under Ray, on SIGTERM (``timeout``, a job scheduler, ``kill``):
a driver's ``ray.init`` installs abseil's failure signal handler, which prints a C++
stack and aborts the process when its shutdown takes over 3 seconds, and a Python
handler that exits with status 15 (checked on Ray 2.60). A ``raykv demo`` stopped by
``timeout`` left the engine's ``/dev/shm`` segment and the demo's fs root behind.

Only the ``raykv`` command turns this on (``termination_handled``): a program that uses
raykv as a library keeps its own signal handling. ``ray.init`` replaces the SIGTERM
handler, so the command's code calls ``after_ray_init`` after each ``ray.init``.
A process raykv joins to Ray as a guest (a vLLM engine's) keeps its handling as it
was (``left_alone_by_ray_init``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

#: The signals that stop a command with its clean-up (Ctrl-C's SIGINT already does).
TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_enabled = False
_received: int | None = None


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by a termination signal (a ``KeyboardInterrupt``, so
    that whatever stops on Ctrl-C stops on it too; Ray's ``ray.get`` raises a plain
    ``KeyboardInterrupt`` for it: ``received()`` tells which signal it was)."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _received
    if _received is not None:  # a second one: stop now, without the clean-up
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received = signum
    raise Terminated(signal.Signals(signum).name)


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # Python runs signal handlers in the main thread only
    for sig in TERMINATION_SIGNALS:
        signal.signal(sig, _on_signal)


@contextlib.contextmanager
def _handlers_kept(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Inside, a driver's ``ray.init`` installs no abseil failure signal handler (Ray
    reads ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` into ``ray_constants`` at import and
    looks it up there at each ``ray.init``; no public switch, checked on Ray 2.60). On
    leaving, that setting and the Python handlers of ``signals`` are as they were."""
    from ray._private import ray_constants

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in signals} if main_thread else {}
    disabled = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = disabled
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def left_alone_by_ray_init() -> Iterator[None]:
    """A ``ray.init`` inside leaves the process's signal handling as it was.

    A driver's ``ray.init`` replaces the Python SIGTERM handler with its own
    ``sys.exit`` and installs abseil's failure signal handler, which prints a C++ stack
    on every SIGTERM and aborts the process (SIGABRT, a core file) when a shutdown takes
    over 3 seconds. In a vLLM engine process, which stops on SIGTERM from its parent,
    that turns each clean stop into stack dumps."""
    with _handlers_kept((signal.SIGTERM,)):
        yield


@contextlib.contextmanager
def termination_handled() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise ``Terminated`` in this process, also after
    ``ray.init`` calls that ``after_ray_init`` follows (a second signal kills at once),
    and Ray's drivers install no abseil failure signal handler. On leaving, the previous
    handlers and setting come back (``raykv.ops.cli.main`` runs in-process in tests, and
    may in users' scripts)."""
    global _enabled, _received
    with _handlers_kept(TERMINATION_SIGNALS):
        _enabled, _received = True, None
        _install()
        try:
            yield
        finally:
            _enabled = False


def after_ray_init() -> None:
    """Put the handlers back after ``ray.init`` replaced them; a no-op unless
    inside ``termination_handled``."""
    if _enabled:
        _install()


def received() -> int | None:
    """The termination signal this process received, if any."""
    return _received
