"""raykv's own log level, from ``RAYKV_LOG_LEVEL`` (for example ``debug``).

Engine processes (vLLM's engine core, Serve replicas) configure the ``vllm`` and
``ray`` loggers, not raykv's, so raykv's debug lines (the compute-once rule's
decisions, lookup waits) are dropped there. Set ``RAYKV_LOG_LEVEL`` in the
environment the processes inherit (``runtime_env.env_vars`` on a real cluster) and
every process that imports raykv logs at that level to its stderr, which Ray
keeps in the worker's log file. ``raykv.serve.llm_config`` and the demo's replicas
pass the deployer's own ``RAYKV_LOG_LEVEL`` on to the engines.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

#: The environment variable read at import.
LOG_LEVEL_ENV = "RAYKV_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")


def configure_from_env() -> None:
    """Apply ``RAYKV_LOG_LEVEL`` to the ``raykv`` logger (no-op when unset).

    A value outside ``LEVELS`` is reported once on stderr and ignored: an import
    must not fail over a log setting."""
    value = os.environ.get(LOG_LEVEL_ENV, "").strip().lower()
    if not value:
        return
    if value not in LEVELS:
        print(
            f"raykv: {LOG_LEVEL_ENV}={value!r} ignored: allowed values are {', '.join(LEVELS)}",
            file=sys.stderr,
        )
        return
    logger = logging.getLogger("raykv")
    logger.setLevel(value.upper())
    if not any(getattr(h, "_raykv_env", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
        handler._raykv_env = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False  # one line per record, not one more through a configured root


def configure_cli() -> None:
    """The command line's warnings: one line each on stderr, as ``raykv: warning: ...``
    (``raykv: error: ...`` is the CLI's own). Leaves a ``RAYKV_LOG_LEVEL`` handler alone."""
    logger = logging.getLogger("raykv")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_CliFormatter())
    logger.addHandler(handler)


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"raykv: {record.levelname.lower()}: {record.getMessage()}"


class Throttled:
    """A warning that can repeat every engine step (a dead directory, say): logged at most
    once per ``period_s`` per message, with how many were not logged in between."""

    def __init__(
        self, log: logging.Logger, period_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.period_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, message: str, *args: object, key: str | None = None) -> bool:
        """Log ``message % args`` unless the same ``key`` (default: the message) was logged
        less than ``period_s`` ago; True when logged."""
        key = message if key is None else key
        now = self._clock()
        with self._lock:
            if now - self._last.get(key, -1e18) < self.period_s:
                self._quiet[key] = self._quiet.get(key, 0) + 1
                return False
            self._last[key] = now
            quiet = self._quiet.pop(key, 0)
        more = f" (and {quiet} more like it since the last report)" if quiet else ""
        self.log.warning(message + "%s", *args, more)
        return True
