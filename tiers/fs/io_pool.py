"""A small priority thread pool: loads are served ahead of stores.

One heap of ``(priority, seq, task)``; every worker takes the most urgent
task (lowest priority value, then oldest). Loads (priority ``LOAD``) sit in
front of any queued store (``STORE``), so a promotion that the engine waits
on never queues behind a burst of background offloads. Tasks are single
blocks, so a long store job yields to a load after at most one block per
worker. The I/O itself (``os.preadv``/``os.pwritev``/``zlib.crc32``, pyarrow
reads and writes) releases the GIL, so threads overlap for real.

Every task comes with an ``on_cancel`` callback: at ``shutdown`` queued tasks
are not run but cancelled, so whoever waits on them (a job) still finishes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

LOAD = 0
STORE = 1


class IoPool:
    def __init__(self, num_threads: int, name: str = "raykv-fs-io") -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Callable[[], None], Callable[[], None] | None]] = []
        self._seq = itertools.count()
        self._closed = False
        self._running = 0
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(
        self,
        priority: int,
        task: Callable[[], None],
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        """Queue ``task``; never blocks. After shutdown the task is cancelled at once."""
        with self._cond:
            if not self._closed:
                heapq.heappush(self._heap, (priority, next(self._seq), task, on_cancel))
                self._cond.notify()
                return
        _call(on_cancel)

    def submit_many(self, priority: int, tasks: Sequence[tuple[Callable[[], None], Callable[[], None] | None]]) -> None:
        with self._cond:
            if not self._closed:
                for task, on_cancel in tasks:
                    heapq.heappush(self._heap, (priority, next(self._seq), task, on_cancel))
                self._cond.notify(len(tasks))
                return
        for _, on_cancel in tasks:
            _call(on_cancel)

    @property
    def backlog(self) -> int:
        """Tasks queued or running."""
        with self._cond:
            return len(self._heap) + self._running

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._heap and not self._running, timeout)

    def shutdown(self, wait: bool = True, timeout: float = 30.0) -> None:
        """Stop taking tasks; cancel the queued ones; let running ones finish."""
        with self._cond:
            self._closed = True
            queued = self._heap
            self._heap = []
            self._cond.notify_all()
        for _, _, _, on_cancel in sorted(queued, key=lambda t: t[:2]):
            _call(on_cancel)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return  # closed and empty
                _, _, task, _ = heapq.heappop(self._heap)
                self._running += 1
            try:
                task()
            except BaseException:  # tasks report their own errors; never kill a worker
                logger.exception("fs I/O task raised")
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()


def _call(fn: Callable[[], None] | None) -> None:
    if fn is None:
        return
    try:
        fn()
    except BaseException:
        logger.exception("fs I/O cancel callback raised")
