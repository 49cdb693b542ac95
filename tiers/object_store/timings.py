"""``Timings``: how long an actor's recent operations took, for its stats."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from raykv.core.wire import Report

logger = logging.getLogger(__name__)


class Timings:
    """The last ``keep`` durations of each named operation."""

    def __init__(self, names: Iterable[str], keep: int = 64) -> None:
        self._seconds: dict[str, deque[float]] = {name: deque(maxlen=keep) for name in names}

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name].append(seconds)

    def median_ms(self) -> Report:
        """``<name>_ms_p50`` of each operation (0.0 before the first)."""
        return {f"{name}_ms_p50": float(np.median(xs) * 1000) if xs else 0.0 for name, xs in self._seconds.items()}


#: A load that takes longer than this is logged with where its time went.
SLOW_LOAD_S = 5.0


def slow_load(
    job_id: int, keys: int, local_packs: int, remote_packs: int, seconds: float, phases: Sequence[tuple[str, float]]
) -> bool:
    """Log a load past ``SLOW_LOAD_S`` with its phases (finding peers' packs, getting
    local packs, pulling remote ones); whether it was slow. A remote pull that
    waits out ``remote_timeout_s`` shows here, not only as a slow request."""
    if seconds <= SLOW_LOAD_S:
        return False
    where = ", ".join(f"{name} {s:.2f} s" for name, s in phases)
    logger.warning(
        "slow load: job %d, %d keys (%d local packs, %d remote) took %.1f s: %s",
        job_id,
        keys,
        local_packs,
        remote_packs,
        seconds,
        where,
    )
    return True
