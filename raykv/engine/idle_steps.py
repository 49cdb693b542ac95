"""A CPU engine's scheduler pauses while every request it has waits for another engine.

A request that waits for another engine's copy (or for its own claim's answer) is
answered RETRY at every step, and a scheduler with requests steps again at once: on a
CPU engine that empty loop (the scheduler, the worker's empty step, raykv's lookups)
takes the cores the engine computing the blocks needs. ``IdleSteps`` knows the
process's live requests (``started`` .. ``finished``) and those held back in the
current step (``held``); at the step's end, when every live request was held back, the
step ran nothing and the engine sleeps: ``FIRST_PAUSE_S``, doubling with each such step
in a row up to ``MAX_PAUSE_S``; a claim's answer ends the pause at once. A step that ran
anything pauses not at all: its forward pass is no spin, and a pause would slow the
requests it runs. A GPU engine's loop costs no GPU time: it never pauses.

The scheduler calls everything here from its one thread. The time slept is counted
in ``COUNTS.idle_ns``: the engine had nothing to run, so it is not raykv's step cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from raykv.metrics.step_cost import COUNTS

#: The first pause of an idle step; each idle step in a row doubles it.
FIRST_PAUSE_S = 0.002
#: The longest pause: a copy (or a new request) is noticed at most this late. A copy
#: comes seconds after its compute started, so 50 ms is a few percent of the wait. An
#: empty step costs a CPU engine 3-4 ms of CPU on a loaded 2-core host (vLLM's scheduler,
#: the worker's empty step, raykv's lookups): at 20 ms a waiting engine still took
#: 0.15-0.2 cores from the one computing the blocks (``raykv bench fork``).
MAX_PAUSE_S = 0.05
#: Idle steps further apart than this are not in a row: the next pause starts short again.
STREAK_GAP_S = 0.5
#: Most live requests remembered (oldest forgotten first): far above an engine's queue, a
#: bound in case a finish is never reported (a forgotten one can only make a step look idle).
MAX_LIVE = 65_536


class IdleSteps:
    """One engine process's live and held-back requests, and its idle-step pauses."""

    def __init__(
        self,
        pauses: Callable[[], bool],
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: Whether this engine pauses at all (a CPU engine), asked at each idle step.
        self._pauses = pauses
        self._sleep = sleep
        self._clock = clock
        self._live: dict[str, None] = {}  # insertion-ordered: the oldest go first past MAX_LIVE
        self._held: set[str] = set()
        self._wakes: list[Future[int]] = []
        self._streak = 0
        self._last_idle = -float("inf")
        #: Idle steps paused, and the seconds slept (tests, debugging).
        self.idle_steps = 0
        self.slept_s = 0.0

    def started(self, req_id: str) -> None:
        """A request joined the engine (every tier reports it: once is enough)."""
        live = self._live
        live[req_id] = None
        if len(live) > MAX_LIVE:
            del live[next(iter(live))]

    def finished(self, req_id: str) -> None:
        """A request left the engine."""
        self._live.pop(req_id, None)
        self._held.discard(req_id)

    def held(self, req_id: str, wake: Future[int] | None = None) -> None:
        """The request was answered RETRY this step to wait for a copy or a claim (``wake``:
        the claim's answer, which ends a pause at once: the request computes or waits then)."""
        self._held.add(req_id)
        if wake is not None:
            self._wakes.append(wake)

    def step_end(self) -> float:
        """End the step: pause when it was idle (every live request held back). The
        first tier's call decides; later tiers' calls in the same step find nothing held.
        Returns the pause (0: none; a claim's answer may have ended it sooner)."""
        wakes, self._wakes = self._wakes, []  # this step's claims only, whatever happens next
        if not self._held:
            return 0.0
        idle = self._live.keys() <= self._held
        self._held.clear()
        if not idle:
            self._streak = 0
            return 0.0
        if not self._pauses():
            return 0.0
        now = self._clock()
        if now - self._last_idle > STREAK_GAP_S:
            self._streak = 0
        pause = min(MAX_PAUSE_S, FIRST_PAUSE_S * 2**self._streak)
        self._streak = min(self._streak + 1, 16)
        t0 = time.perf_counter_ns()
        if wakes:
            wait(wakes, timeout=pause, return_when=FIRST_COMPLETED)
        else:
            self._sleep(pause)
        slept_ns = time.perf_counter_ns() - t0
        COUNTS.idle_ns += slept_ns
        self._last_idle = self._clock()
        self.idle_steps += 1
        self.slept_s += slept_ns / 1e9
        return pause
