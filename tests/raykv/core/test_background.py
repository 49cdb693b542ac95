"""Background threads wait for Ray answers outside Ray, and stop when their session ends."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from raykv.core.background import SLICE_S, SessionEnded, wait_answer
from raykv.core.node import ray_session
from tests.clusters import start_local_ray


@ray.remote(num_cpus=0)
class _Answers:
    def echo(self, value: int) -> int:
        return value

    def fail(self) -> None:
        raise ValueError("refused")

    def hang(self) -> None:
        time.sleep(3600)


def _start_ray() -> None:
    start_local_ray(num_cpus=2)


def test_answers_errors_and_timeouts_are_ray_gets() -> None:
    _start_ray()
    try:
        actor = _Answers.remote()
        session = ray_session()
        assert wait_answer(actor.echo.remote(7), 30, session) == 7
        with pytest.raises(ValueError, match="refused"):
            wait_answer(actor.fail.remote(), 30, session)
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.GetTimeoutError):
            wait_answer(actor.hang.remote(), 0.3, session)
        assert time.monotonic() - t0 < 0.3 + 5 * SLICE_S
    finally:
        ray.shutdown()


@pytest.mark.long  # three Ray sessions
def test_a_waiting_thread_ends_with_its_session_and_ray_starts_again() -> None:
    """ray-project/ray#31145: a thread inside ray.wait across ray.shutdown crashes the
    process later. Here the thread waits outside Ray and leaves once the session ends."""
    for _ in range(3):
        _start_ray()
        actor = _Answers.remote()
        session = ray_session()
        outcome: list[BaseException] = []
        ready = threading.Event()

        def wait() -> None:
            ref = actor.hang.remote()
            ready.set()
            try:
                wait_answer(ref, 3600, session)
            except BaseException as e:  # noqa: BLE001 - what ended the wait is the result
                outcome.append(e)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        assert ready.wait(30)
        time.sleep(0.2)
        ray.shutdown()
        waiter.join(5)
        assert not waiter.is_alive()
        # Ray may fail the pending call as it shuts down (ActorDiedError) before the
        # wait sees the session end: either way the thread left, outside Ray.
        assert len(outcome) == 1 and isinstance(outcome[0], SessionEnded | ray.exceptions.RayError), outcome
