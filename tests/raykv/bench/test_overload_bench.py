"""``raykv bench overload``: the pure parts (error causes, per-second buckets, the Poisson
schedule, histogram bounds, summaries, targets, the open loop against a fake server) unmarked,
and one quick real run through Serve (marked ``serve``)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from raykv.bench import overload
from raykv.bench.overload import CAUSES, Outcome
from raykv.ops.cli import build_parser

# ---------------------------------------------------------------- error causes


@pytest.mark.parametrize(
    ("text", "timed_out", "cause"),
    [
        (
            "RuntimeError: HTTP 503: b'Request dropped due to backpressure (num_queued_requests=16)'",
            False,
            "backpressure",
        ),
        ("RuntimeError: HTTP 429: b'too many'", False, "backpressure"),
        ("RuntimeError: HTTP 500: b'BackPressureError: Request dropped due to backpressure'", False, "backpressure"),
        ("TimeoutError: timed out", True, "timeout"),
        ("RuntimeError: HTTP 504: b'gateway'", False, "timeout"),
        ("RuntimeError: HTTP 408: b'Request abc timed out after 30 s.'", False, "timeout"),
        ("RuntimeError: HTTP 500: b'raykv.core.errors.RaykvError: directory shard gone'", False, "raykv"),
        ("RuntimeError: stream error: RaykvError in the tier", False, "raykv"),
        ("RuntimeError: HTTP 500: b'EngineDeadError'", False, "other"),
        ("RemoteDisconnected: Remote end closed connection without response", False, "other"),
    ],
)
def test_classify(text: str, timed_out: bool, cause: str) -> None:
    assert overload.classify(text, timed_out=timed_out) == cause


def test_classify_ignores_the_model_path_under_raykvs_cache() -> None:
    path = "/home/u/.cache/raykv/models/bench"
    text = f"RuntimeError: HTTP 500: b'model {path} failed: EngineDeadError'"
    assert overload.classify(text) == "raykv"
    assert overload.classify(text, ignore=[path]) == "other"


# ---------------------------------------------------------------- Poisson schedule


def test_poisson_schedule() -> None:
    times = overload.poisson_schedule(20.0, 100.0, seed=3)
    assert times == sorted(times) and all(0 < t < 100 for t in times)
    assert 1800 < len(times) < 2200  # 20/s for 100 s: 2000, sd ~45
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    assert 0.045 < mean < 0.055
    # exponential gaps: their standard deviation is their mean (not a fixed pace)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert 0.8 < sd / mean < 1.2
    assert overload.poisson_schedule(20.0, 100.0, seed=3) == times
    assert overload.poisson_schedule(20.0, 100.0, seed=4) != times
    assert overload.poisson_schedule(0.0, 10.0) == [] and overload.poisson_schedule(5.0, 0.0) == []


# ---------------------------------------------------------------- per-second buckets


def _ok(end: float, ttft: float) -> Outcome:
    return Outcome(0.0, end, ttft)


def _err(end: float, cause: str) -> Outcome:
    return Outcome(0.0, end, None, cause, "x")


def test_per_second_buckets_by_end_time() -> None:
    outs = [_ok(0.2, 10), _ok(0.9, 30), _err(0.5, "timeout"), _ok(2.1, 50), _err(2.9, "backpressure")]
    rows = overload.per_second(outs, seconds=4)
    assert [r["t"] for r in rows] == [0, 1, 2, 3]
    assert [r["completed"] for r in rows] == [2, 0, 1, 0]
    assert rows[0]["errors"] == {"backpressure": 0, "timeout": 1, "raykv": 0, "other": 0}
    assert rows[2]["errors"]["backpressure"] == 1
    assert rows[0]["ttft_p50_ms"] == 20 and rows[0]["ttft_p99_ms"] == pytest.approx(29.8)
    assert rows[1]["ttft_p50_ms"] is None and rows[3]["ttft_p99_ms"] is None
    assert len(overload.per_second(outs)) == 3  # as many as the last end needs
    assert len(overload.per_second([_ok(7.5, 1)], seconds=3)) == 8


def test_bucket_bound() -> None:
    before = {0.01: 5.0, 0.1: 5.0, 1.0: 5.0, math.inf: 5.0}
    after = {0.01: 95.0, 0.1: 104.0, 1.0: 105.0, math.inf: 105.0}  # 100 new: 90 <= 10 ms, 9 <= 100 ms, 1 <= 1 s
    assert overload.bucket_bound(before, after, 0.5) == 0.01
    assert overload.bucket_bound(before, after, 0.99) == 0.1
    assert overload.bucket_bound(before, after, 1.0) == 1.0
    assert overload.bucket_bound(after, after, 0.99) is None
    assert overload.bucket_bound({}, {}, 0.5) is None


def test_figures_are_deltas_between_reads() -> None:
    before = overload.Metrics({"ray_raykv_router_decision_seconds_count": 10.0}, {})
    after = overload.Metrics(
        {
            "ray_raykv_router_decision_seconds_count": 30.0,
            "ray_raykv_engine_step_seconds_count": 500.0,
            "ray_raykv_lookup_retry_budget_misses_total": 7.0,
            "ray_raykv_router_fallbacks_total": 3.0,
        },
        {"ray_raykv_router_decision_seconds": {0.001: 19.0, 0.01: 20.0, math.inf: 20.0}},
    )
    f = overload.figures(before, after)
    assert f["router_decisions"] == 20 and f["engine_steps"] == 500 and f["retry_budget_misses"] == 7
    assert f["router_decision_p99_le_s"] == 0.01 and f["router_decision_max_le_s"] == 0.01
    assert f["engine_step_max_le_s"] is None and f["lookups"] == 0 and f["router_fallbacks"] == 3


# ---------------------------------------------------------------- summaries and targets


def test_scenario_summary_and_targets() -> None:
    outs = [_ok(0.5, 100), _ok(1.5, 300), _err(1.7, "backpressure"), _err(2.2, "backpressure")]
    s = overload.scenario_summary(outs, capacity=2.0, rate=4.0, duration_s=2.0)
    assert s["sent"] == 4 and s["completed"] == 2 and s["completed_per_s"] == 1.0
    assert s["errors"] == {"backpressure": 2, "timeout": 0, "raykv": 0, "other": 0}
    assert s["error_share"] == 0.5 and s["error_samples"] == {"backpressure": "x"}
    assert s["ttft_p50_ms"] == 200 and len(s["per_second"]) == 3
    bad = overload.scenario_summary([_err(0.1, "raykv")], 2.0, 4.0, 1.0)
    ts = overload.targets({"healthy": s, "dead_shard": bad, "slow_shard": {"error": "boom"}})
    verdicts = {t["target"]: t["passed"] for t in ts}
    assert verdicts == {
        "healthy: raykv-caused errors": True,
        "dead_shard: raykv-caused errors": False,
        "slow_shard: raykv-caused errors": None,
    }
    text = overload.format_result(
        {**_result(), "scenarios": {"healthy": s, "slow_shard": {"error": "boom"}}, "targets": ts}
    )
    assert "healthy, per second" in text and "failed: boom" in text and "err backpressure" in text


def _result() -> overload.OverloadResult:
    args = _args()
    overload._check(args)
    return overload._result(args, {}, "tiny", {})


# ---------------------------------------------------------------- options


def _args(*argv: str):
    return build_parser().parse_args(["bench", "overload", *argv])


def test_options() -> None:
    args = _args()
    assert args.load == 2.0 and args.shard_delay_ms == 500
    assert overload._scenarios(args) == list(overload.SCENARIOS)
    assert overload._scenarios(_args("--scenarios", "healthy,dead_shard")) == ["healthy", "dead_shard"]
    with pytest.raises(ValueError, match="--scenarios"):
        overload._scenarios(_args("--scenarios", "healthy,flaky"))
    overload._check(args)
    assert args.capacity_concurrency == 8
    assert args.replicas == 2 and args.prompts == 64 and args.duration_s == 180
    quick = _args("--quick")
    overload._check(quick)
    assert quick.duration_s == overload.QUICK["duration_s"] and quick.replicas == 2
    # an option given with --quick wins over --quick's default
    quick3 = _args("--quick", "--replicas", "3", "--duration-s", "40")
    overload._check(quick3)
    assert (quick3.replicas, quick3.duration_s, quick3.capacity_concurrency) == (3, 40.0, 12)
    assert quick3.capacity_s == overload.QUICK["capacity_s"]
    with pytest.raises(ValueError, match="--replicas"):
        overload._check(_args("--replicas", "1"))
    with pytest.raises(ValueError, match="--kill-at"):
        overload._check(_args("--kill-at", "1.5"))


# ---------------------------------------------------------------- open and closed loops (no server)


def test_open_loop_never_waits_for_answers() -> None:
    lock = threading.Lock()
    started: list[float] = []

    def send(prompt: str) -> float:
        with lock:
            started.append(time.perf_counter())
        if prompt == "busy":
            raise RuntimeError("HTTP 503: b'Request dropped due to backpressure'")
        time.sleep(0.5)  # not a wait: a slow server's answer, which the sender must not wait for
        return 42.0

    schedule = [0.01 * i for i in range(20)]
    outs, t0 = overload.open_loop(schedule, ["ok"], send, drain_s=5)
    assert len(outs) == 20 and all(o.cause is None and o.ttft_ms == 42.0 for o in outs)
    assert max(started) - t0 < 0.4  # all 20 sent within the 0.2 s schedule, before any answer
    outs, _ = overload.open_loop([0.0, 0.01], ["busy"], send, drain_s=5)
    assert [o.cause for o in outs] == ["backpressure", "backpressure"]


def test_open_loop_counts_requests_still_open_as_timeouts() -> None:
    release = threading.Event()

    def send(prompt: str) -> float:
        release.wait(5)  # a server that does not answer within the drain
        return 1.0

    outs, _ = overload.open_loop([0.0, 0.0, 0.0], ["p"], send, drain_s=0.2)
    release.set()
    assert [o.cause for o in outs] == ["timeout"] * 3


def test_closed_loop_measures_completions_per_second() -> None:
    def send(prompt: str) -> float:
        time.sleep(0.05)  # not a wait: a server that serves one request in 50 ms per client
        return 1.0

    rps = overload.closed_loop(["p"], send, concurrency=2, duration_s=0.5)
    assert 20 < rps <= 42  # 2 clients x 20/s, less thread start-up


def test_all_causes_are_reported() -> None:
    assert CAUSES == ("backpressure", "timeout", "raykv", "other")


# ---------------------------------------------------------------- a real run
