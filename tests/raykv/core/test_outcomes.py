"""An actor call's outcome is read as Ray hands it over: values, errors and deaths, no ``ray.wait``;
many calls' answers are waited for under one deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from raykv.core.outcomes import CallOutcome, NoAnswer, answers_within, wait_all


@ray.remote(num_cpus=0, max_restarts=0)
class _Calls:
    def echo(self, value: int) -> int:
        return value

    def fail(self) -> None:
        raise ValueError("refused")

    async def hang(self) -> None:
        await asyncio.Event().wait()


def _until_finished(outcome: CallOutcome, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not outcome.finished:
        assert time.monotonic() < deadline, "the call never finished"
        time.sleep(0.01)


def test_values_errors_and_deaths_arrive_without_a_wait(ray_local: None) -> None:
    actor = _Calls.remote()
    value = CallOutcome(actor.echo.remote(7))
    _until_finished(value)
    assert value.poll() == (True, 7, None)
    assert value.value() == 7

    failed = CallOutcome(actor.fail.remote())
    _until_finished(failed)
    done, got, error = failed.poll()
    assert done and got is None
    assert isinstance(error, ValueError) and "refused" in str(error)
    with pytest.raises(ValueError, match="refused"):
        failed.value()  # raised, as ray.get would

    hanging = CallOutcome(actor.hang.remote())
    time.sleep(0.2)
    assert not hanging.finished and hanging.poll() == (False, None, None)
    ray.kill(actor)
    _until_finished(hanging)  # the death ends the call that never returns
    done, _, error = hanging.poll()
    assert done and isinstance(error, ray.exceptions.RayActorError)


def test_wait_all_blocks_until_every_call_ended_or_the_timeout(ray_local: None) -> None:
    actor = _Calls.remote()
    try:
        quick = [CallOutcome(actor.echo.remote(i)) for i in range(3)]
        assert wait_all(quick, 30.0)
        assert [o.poll()[1] for o in quick] == [0, 1, 2]

        stuck = [CallOutcome(actor.echo.remote(3)), CallOutcome(actor.hang.remote())]
        t0 = time.monotonic()
        assert not wait_all(stuck, 0.3)
        assert 0.25 <= time.monotonic() - t0 < 10
        assert not wait_all(stuck, 0.0)  # a poll: no wait
    finally:
        ray.kill(actor)


@pytest.mark.parametrize("timeout_s", [0.0, 0.05])
def test_wait_all_of_nothing_is_done(timeout_s: float) -> None:
    assert wait_all([], timeout_s)


def test_answers_within_waits_one_timeout_for_all_the_calls_that_hang(ray_local: None) -> None:
    actor = _Calls.remote()
    try:
        assert ray.get(actor.echo.remote(0), timeout=60) == 0  # started: its start is not what is timed
        refs = {"value": actor.echo.remote(1), "error": actor.fail.remote()}
        refs.update({f"hung{i}": actor.hang.remote() for i in range(3)})
        t0 = time.monotonic()
        answers = answers_within(refs, 0.5)
        took = time.monotonic() - t0
        assert 0.45 <= took < 1.4, took  # one 0.5 s timeout (a ray.get per call: 1.5 s)
        assert answers["value"] == 1
        assert isinstance(answers["error"], ValueError) and "refused" in str(answers["error"])
        for i in range(3):
            hung = answers[f"hung{i}"]
            assert isinstance(hung, NoAnswer) and str(hung) == "no answer in 0.5 s"
        assert answers_within({}, 1.0) == {}
    finally:
        ray.kill(actor)
