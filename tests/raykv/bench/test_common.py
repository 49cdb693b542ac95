"""raykv.bench.common: helpers every bench shares."""

from __future__ import annotations

import threading
import time

from raykv.bench.common import all_at_once


def test_all_at_once_releases_every_send_together_and_keeps_each_error() -> None:
    started: list[float] = []
    lock = threading.Lock()

    def send(i: int) -> int:
        with lock:
            started.append(time.monotonic())
        if i == 2:
            raise ValueError("refused")
        time.sleep(0.2)
        return i * 10

    t0 = time.monotonic()
    out = all_at_once(send, [0, 1, 2, 3])
    assert out[:2] == [0, 10] and out[3] == 30
    assert isinstance(out[2], ValueError) and str(out[2]) == "refused"
    assert max(started) - min(started) < 0.15  # released by one barrier, not one after another
    assert time.monotonic() - t0 < 0.6  # the sends overlap
    assert all_at_once(send, []) == []
