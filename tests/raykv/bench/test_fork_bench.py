"""``raykv bench fork``'s accounting (no cluster: its records and targets); the
bench itself runs with ``raykv bench fork --quick`` (docs/PERFORMANCE.md)."""

from __future__ import annotations

import argparse

import pytest

from raykv.bench import fork
from raykv.ops.cli import build_parser


def _args(**kw: object) -> argparse.Namespace:
    base = {"forks": 3, "bursts": 2, "prefix_tokens": 300, "suffix_tokens": 8}
    return argparse.Namespace(**{**base, **kw})


def _record(burst: int, cached: int, ttft_ms: float) -> fork.RequestRecord:
    cacheable = fork.full_block_tokens(300)  # 256: two full blocks
    return {
        "burst": burst,
        "prompt_tokens": 308,
        "cached_tokens": cached,
        "prefix_computed_tokens": max(0, cacheable - cached),
        "ttft_ms": ttft_ms,
    }


def test_the_prefix_multiple_counts_every_uncached_prefix_token_of_a_burst() -> None:
    assert fork.full_block_tokens(300) == 256 and fork.full_block_tokens(2048) == 2048
    # burst 0: one request computed the prefix, two found it cached (engine or raykv)
    # burst 1: two computed it; the third found half of it
    records = [_record(0, 0, 900), _record(0, 256, 300), _record(0, 256, 320)]
    records += [_record(1, 0, 950), _record(1, 0, 1000), _record(1, 128, 600)]
    got = fork._summary(records, _args(), busy_s=3.0)
    assert got["prefix_multiples"] == [1.0, 2.5]
    assert got["prefix_multiple"] == pytest.approx(1.75)
    assert got["requests_per_s"] == pytest.approx(2.0)
    assert got["cached_tokens"] == 640 and got["prompt_tokens"] == 6 * 308


def test_targets_hold_the_worst_burst_and_compare_ttft_with_today() -> None:
    today = fork._summary([_record(0, 0, 1000), _record(0, 0, 1000), _record(0, 0, 1000)], _args(bursts=1), 1.0)
    once = fork._summary([_record(0, 0, 700), _record(0, 256, 500), _record(0, 256, 500)], _args(bursts=1), 1.0)
    twice = fork._summary([_record(0, 0, 900), _record(0, 0, 900), _record(0, 256, 500)], _args(bursts=1), 1.0)
    targets = {t["target"]: t for t in fork._targets({"today": today, "pending": once, "router": twice})}
    assert targets["prefix computed cluster-wide, worst burst, pending (x one prefix)"]["passed"] is True
    assert targets["prefix computed cluster-wide, worst burst, router (x one prefix)"]["passed"] is False
    assert targets["TTFT p90, pending / today"]["passed"] is True  # 0.7
    assert targets["TTFT p90, router / today"]["passed"] is False  # 0.9
    # a failed configuration is reported, not compared
    assert fork._targets({"today": {"error": "x"}, "pending": once})[0]["passed"] is True
    text = fork.format_result(
        {
            "benchmark": "fork",
            "machine": {},
            "replicas": 3,
            "forks": 3,
            "prefix_tokens": 300,
            "cacheable_prefix_tokens": 256,
            "suffix_tokens": 8,
            "bursts": 1,
            "model": "tiny",
            "configs": {"today": today, "pending": once, "router": {"error": "RuntimeError: boom"}},
            "targets": fork._targets({"today": today, "pending": once}),
        }
    )
    assert "failed: RuntimeError: boom" in text and "3.00" in text and "1.00" in text


def test_its_options_are_checked_before_a_cluster_starts() -> None:
    parse = build_parser().parse_args
    args = parse(["bench", "fork", "--configs", "today,nonsense"])
    with pytest.raises(ValueError, match="--configs"):
        fork.run(args)
    with pytest.raises(ValueError, match="--replicas"):
        fork.run(parse(["bench", "fork", "--replicas", "1"]))
    with pytest.raises(ValueError, match="max_model_len"):
        fork.run(parse(["bench", "fork", "--prefix-tokens", "4000", "--suffix-tokens", "200"]))
    with pytest.raises(ValueError, match="32768"):  # past even the long bench model's positions
        fork.run(parse(["bench", "fork", "--model", "bench-long", "--prefix-tokens", "40000"]))
    with pytest.raises(ValueError, match="--pending-max-wait-ms"):
        fork.run(parse(["bench", "fork", "--pending-max-wait-ms", "-1"]))


def test_engines_fit_twice_a_long_fork() -> None:
    """A prefix past the default cache gets engines of twice a fork's prompt (the long model's)."""
    assert fork.engine_blocks(_args(prefix_tokens=2048, suffix_tokens=32)) == fork.ENGINE_BLOCKS
    long = fork.engine_blocks(_args(prefix_tokens=6144, suffix_tokens=32))
    assert long * fork.BLOCK >= 2 * (6144 + 32) and long == 2 * 49
