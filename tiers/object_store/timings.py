"""``Timings``: how long an actor's recent operations took, for its stats."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from raykv.core.wire import Report


class Timings:
    """The last ``keep`` durations of each named operation."""

    def __init__(self, names: Iterable[str], keep: int = 64) -> None:
        self._seconds: dict[str, deque[float]] = {name: deque(maxlen=keep) for name in names}

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name].append(seconds)

    def median_ms(self) -> Report:
        """``<name>_ms_p50`` of each operation (0.0 before the first)."""
        return {f"{name}_ms_p50": float(np.median(xs) * 1000) if xs else 0.0 for name, xs in self._seconds.items()}
