"""A CPU engine's idle steps pause, growing while they follow each other; busy steps never pause."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from raykv.engine import idle_steps as idle_steps_module
from raykv.engine.idle_steps import FIRST_PAUSE_S, MAX_LIVE, MAX_PAUSE_S, STREAK_GAP_S, IdleSteps
from raykv.metrics.step_cost import COUNTS, StepCost


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def idle_steps(clock: Clock, cpu: bool = True) -> IdleSteps:
    return IdleSteps(lambda: cpu, sleep=clock.sleep, clock=clock)


def test_a_step_where_every_request_waits_pauses_longer_each_step_in_a_row() -> None:
    clock = Clock()
    steps = idle_steps(clock)
    steps.started("a")
    steps.started("b")
    pauses = []
    for _ in range(9):
        steps.held("a")
        steps.held("b")
        pauses.append(steps.step_end())
        assert steps.step_end() == 0.0  # the step's other tiers: nothing held any more
    assert pauses == pytest.approx([min(MAX_PAUSE_S, FIRST_PAUSE_S * 2**i) for i in range(9)])
    assert pauses[-2:] == [MAX_PAUSE_S, MAX_PAUSE_S] and pauses[0] < MAX_PAUSE_S / 8
    assert clock.slept == pauses
    assert steps.idle_steps == 9


def test_a_step_that_runs_a_request_does_not_pause_and_the_next_idle_one_starts_short() -> None:
    clock = Clock()
    steps = idle_steps(clock)
    steps.started("waits")
    steps.started("runs")
    steps.held("waits")
    assert steps.step_end() == 0.0  # "runs" was scheduled: a forward pass, no spin
    steps.finished("runs")
    for _ in range(3):
        steps.held("waits")
        steps.step_end()
    steps.started("new")  # a new request: this step computes it
    steps.held("waits")
    assert steps.step_end() == 0.0
    steps.finished("new")
    steps.held("waits")
    assert steps.step_end() == pytest.approx(FIRST_PAUSE_S)
    assert clock.slept == pytest.approx([FIRST_PAUSE_S, 2 * FIRST_PAUSE_S, 4 * FIRST_PAUSE_S, FIRST_PAUSE_S])


def test_idle_steps_far_apart_are_not_in_a_row() -> None:
    clock = Clock()
    steps = idle_steps(clock)
    for _ in range(4):
        steps.held("a")
        steps.step_end()
    clock.now += STREAK_GAP_S + 0.1
    steps.held("a")
    assert steps.step_end() == pytest.approx(FIRST_PAUSE_S)


def test_no_request_held_or_a_gpu_engine_never_pauses() -> None:
    clock = Clock()
    steps = idle_steps(clock)
    steps.started("a")
    assert steps.step_end() == 0.0  # nothing waits: the step ran "a"
    gpu = idle_steps(clock, cpu=False)
    gpu.started("a")
    gpu.held("a")
    assert gpu.step_end() == 0.0
    assert clock.slept == []


def test_a_finished_request_no_longer_keeps_the_engine_busy() -> None:
    clock = Clock()
    steps = idle_steps(clock)
    steps.started("done")
    steps.started("waits")
    steps.finished("done")
    steps.held("waits")
    assert steps.step_end() == pytest.approx(FIRST_PAUSE_S)


def test_an_idle_pause_is_not_counted_as_raykv_step_cost() -> None:
    """The step meter takes the pause out of its step: the engine had nothing to run."""
    steps = IdleSteps(lambda: True)  # the real clock and sleep
    cost = StepCost(node="n")
    cost.ns = 50_000  # raykv's own work in the step: 50 us
    before = COUNTS.idle_ns
    steps.held("a")
    slept = steps.step_end()
    cost.ns += COUNTS.idle_ns - before  # the tier's on_schedule_end is timed around the pause
    cost.step_end()
    snap = cost.snapshot()
    assert slept == pytest.approx(FIRST_PAUSE_S)
    assert snap["idle_pause_seconds"] >= FIRST_PAUSE_S
    assert snap["tier_seconds"] == pytest.approx(50e-6, abs=1e-9)


def test_a_claims_answer_ends_the_pause_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request held for its claim's answer computes (or waits) as soon as it comes.
    The longest pause is raised to 5 s, so that the answer's thread waking up late on a
    loaded host (tens of ms) cannot pass for a pause that ran its course."""
    longest = 5.0
    monkeypatch.setattr(idle_steps_module, "MAX_PAUSE_S", longest)
    clock = Clock()
    steps = idle_steps(clock)  # the steps without a claim sleep on the test's clock
    for _ in range(13):  # the pause has grown to its longest
        steps.held("a")
        steps.step_end()
    assert clock.slept[-1] == pytest.approx(longest)
    claim: Future[int] = Future()
    steps.held("a", claim)
    timer = threading.Timer(0.002, claim.set_result, (0,))
    timer.start()
    t0 = time.perf_counter()
    assert steps.step_end() == pytest.approx(longest)
    took = time.perf_counter() - t0
    assert claim.done()  # it paused until the answer came...
    timer.join()
    assert took < longest / 2, took  # ...and no longer
    steps.held("a", claim)  # answered already: no pause at all
    t0 = time.perf_counter()
    steps.step_end()
    assert time.perf_counter() - t0 < longest / 2


def test_live_requests_are_bounded() -> None:
    """A finish never reported cannot grow the book without bound."""
    clock = Clock()
    steps = idle_steps(clock)
    for i in range(MAX_LIVE + 10):
        steps.started(f"r{i}")
    assert len(steps._live) == MAX_LIVE
    assert "r0" not in steps._live and f"r{MAX_LIVE + 9}" in steps._live


def test_a_claim_of_a_request_that_finished_does_not_cut_a_later_pause() -> None:
    """A held request that finishes before its step ends leaves no claim behind for the next step."""
    clock = Clock()
    steps = idle_steps(clock)
    claim: Future[int] = Future()
    claim.set_result(0)
    steps.started("gone")
    steps.held("gone", claim)
    steps.finished("gone")
    assert steps.step_end() == 0.0  # nothing held any more
    steps.held("waits")
    assert steps.step_end() == pytest.approx(FIRST_PAUSE_S)
    assert clock.slept == pytest.approx([FIRST_PAUSE_S])  # slept, not cut short by the old claim
