"""``raykv bench overload --quick --json``: the whole bench, run for real (``make test-serve``;
its pure parts are tested in ``tests/raykv/bench/test_overload_bench.py``)."""

from __future__ import annotations

import math

import pytest

from raykv.bench import overload
from raykv.bench.overload import CAUSES
from tests.benches import run_bench


@pytest.mark.serve
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_bench_overload_quick_json(vllm_env) -> None:
    """``raykv bench overload --quick --json``: Serve LLM apps (tiny model, two replicas on two
    simulated nodes), each driven past its capacity; every key reported, no raykv-caused error.
    CI runs the two fault scenarios (a slow shard, a shard killed mid-phase), the ones where
    raykv could cause an error; each is a Serve app of its own (about 2 minutes here), and
    ``healthy`` is the same run with nothing injected."""
    pytest.importorskip("ray.serve.llm")
    scenarios = ("slow_shard", "dead_shard")
    out = run_bench("overload", "--quick", "--scenarios", ",".join(scenarios), timeout=2300)
    assert out["benchmark"] == "overload" and out["model"] == "tiny" and out["replicas"] == 2
    assert set(out["scenarios"]) == set(scenarios) <= set(overload.SCENARIOS)
    rate = None
    for name, s in out["scenarios"].items():
        assert "error" not in s, (name, s)
        assert s["capacity_rps"] > 0 and s["sent"] > 0, name
        rate = rate or s["rate_rps"]
        assert s["rate_rps"] == rate, name  # every scenario gets the first one's offered rate
        assert set(s["errors"]) == set(CAUSES), name
        assert s["errors"]["raykv"] == 0, (name, s["error_samples"])
        assert s["completed"] + sum(s["errors"].values()) == s["sent"], name
        assert s["completed"] > 0 and s["ttft_p99_ms"] >= s["ttft_p50_ms"] > 0, name
        assert len(s["per_second"]) >= math.ceil(out["duration_s"]), name
        assert sum(r["completed"] for r in s["per_second"]) == s["completed"], name
        assert set(s["raykv"]) == set(overload.empty_figures()), name
    assert out["scenarios"]["dead_shard"]["fault_at_s"] is not None
    assert [t["passed"] for t in out["targets"]] == [True] * len(scenarios), out["targets"]
