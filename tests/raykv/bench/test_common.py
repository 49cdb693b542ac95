"""raykv.bench.common: helpers every bench shares."""

from __future__ import annotations

import math
import statistics
import threading
import time

import pytest

from raykv.bench.common import above_zero, all_at_once, at_least, counts_option, ratio_interval
from raykv.core.validate import ArgumentError


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


def test_option_checks_name_the_option_and_what_is_allowed() -> None:
    at_least(1, rounds=3, calls=None)  # None: not given
    with pytest.raises(ArgumentError, match=r"^--io-threads: must be >= 1, got 0$"):
        at_least(1, rounds=3, io_threads=0)
    with pytest.raises(ArgumentError, match=r"^--agent-seconds: must be a finite number of seconds > 0, got -1.0$"):
        above_zero(seconds=None, agent_seconds=-1.0)
    with pytest.raises(ArgumentError, match=r"^--seconds: must be a finite number of seconds > 0, got nan$"):
        above_zero(seconds=float("nan"))
    assert counts_option("--batches", "1, 8,32") == [1, 8, 32]
    assert counts_option("--keys", "2k", lambda s: int(s.rstrip("k")) * 1000) == [2000]
    with pytest.raises(ArgumentError, match=r"^--batches: must be >= 1, got 0$"):
        counts_option("--batches", "4,0")
    with pytest.raises(ArgumentError, match=r"^--shards: 'two' is not a count$"):
        counts_option("--shards", "1,two")


#: Bad options of every benchmark: each is refused before anything starts (no Ray, no vLLM).
BAD_OPTIONS = [
    ("dataplane", "--block-sizes", "0"),
    ("dataplane", "--io-threads", "0"),
    ("dataplane", "--checksum", "bogus"),
    ("dataplane", "--root", "s3://bucket/prefix"),
    ("directory", "--clients", "-1"),
    ("directory", "--shards", "1,x"),
    ("directory", "--seconds", "-1"),
    ("e2e", "--turns", "0"),
    ("e2e", "--concurrency", "-1"),
    ("e2e", "--rounds", "0"),
    ("fork", "--forks", "1"),
    ("fork", "--configs", "today,bogus"),
    ("flood", "--replicas", "1"),
    ("overload", "--replicas", "1"),
    ("overload", "--prompts", "0"),
    ("overload", "--output-tokens", "0"),
    ("overload", "--request-timeout-s", "0"),
    ("overload", "--rate", "-2"),
    ("overload", "--max-queued-requests", "-5"),
    ("overload", "--shard-delay-ms", "-1"),
    ("recompute", "--tokens", "100"),
    ("recompute", "--models", "bench,gpt"),
    ("recompute", "--device", "gpu"),
    ("recompute", "--layers-run", "0"),
    ("routing", "--sessions", "0"),
    ("routing", "--concurrency", "0"),
    ("routing", "--router-option", "nope=1"),
    ("serve", "--concurrency", "0"),
]


@pytest.mark.parametrize(("bench", "option", "value"), BAD_OPTIONS)
def test_a_bad_bench_option_is_bad_input_not_an_unexpected_error(capsys, bench, option, value) -> None:
    """``raykv bench NAME --option BAD``: one line naming the option, exit code 2 (as for
    any bad input), and nothing started: no "unexpected" error, no cluster."""
    _refused(capsys, ["bench", bench, option, value, "--no-progress"], option)


#: Options that ``--quick`` also sets: given with it, the given value counts (here a bad one).
QUICK_AND_GIVEN = [
    ("e2e", "--replicas", "1"),
    ("fork", "--forks", "1"),
    ("routing", "--replicas", "1"),
    ("serve", "--concurrency", "0"),
    ("overload", "--replicas", "1"),
]


@pytest.mark.parametrize(("bench", "option", "value"), QUICK_AND_GIVEN)
def test_an_option_given_with_quick_wins_over_quicks_value(capsys, bench, option, value) -> None:
    _refused(capsys, ["bench", bench, "--quick", option, value, "--no-progress"], option)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], option: str) -> None:
    import ray

    from raykv.ops.cli import main

    was_up = ray.is_initialized()
    t0 = time.monotonic()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert err.startswith(f"raykv: error: {option}") and "\n" not in err, err
    assert "unexpected" not in err
    assert ray.is_initialized() == was_up
    assert time.monotonic() - t0 < 30


def test_bench_directory_skips_a_part_given_zero_and_refuses_agents_only_without_nodes() -> None:
    """``--clients 0`` / ``--nodes 0`` skip their part (as ``--help`` says); ``--agents-only``
    with no node would run nothing."""
    import argparse

    from raykv.bench import directory

    parser = argparse.ArgumentParser()
    directory.add_arguments(parser)
    settings = directory._settings(parser.parse_args(["--clients", "0", "--nodes", "0"]))
    assert settings.clients == 0 and settings.nodes == 0
    with pytest.raises(ArgumentError, match=r"^--nodes: --agents-only"):
        directory._settings(parser.parse_args(["--agents-only", "--nodes", "0"]))


def test_ratio_interval_is_the_geometric_mean_with_a_t_interval_on_the_logs() -> None:
    assert ratio_interval([1.2]) is None  # one round: no spread to judge
    assert ratio_interval([1.0, 0.0]) is None and ratio_interval([1.0, math.inf]) is None
    geo, lo, hi = ratio_interval([1.1, 1.1, 1.1]) or (0, 0, 0)
    assert geo == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    geo, lo, hi = ratio_interval([2.0, 0.5]) or (0, 0, 0)
    # logs +-ln 2: mean 0, sd ln2 * sqrt 2, t(1 df) = 12.71
    half = 12.71 * math.log(2) * math.sqrt(2) / math.sqrt(2)
    assert geo == pytest.approx(1.0) and lo == pytest.approx(math.exp(-half)) and hi == pytest.approx(math.exp(half))
    # 13 rounds (12 df, between the table's 10 and 15) use 10's t: never narrower than the true one (2.18)
    xs = [0.9, 1.1] * 6 + [1.0]
    logs = [math.log(x) for x in xs]
    sd = statistics.stdev(logs)
    geo, lo, hi = ratio_interval(xs) or (0, 0, 0)
    assert math.log(hi / geo) == pytest.approx(2.23 * sd / math.sqrt(13), rel=1e-3)
