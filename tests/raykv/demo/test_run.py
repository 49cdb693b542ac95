"""`raykv demo` end to end (real vLLM replicas on a two-node local Ray), shortened."""

from __future__ import annotations

import pytest
import ray

from raykv.demo.run import demo, format_report

pytestmark = pytest.mark.slow

KEYS = {
    "replicas",
    "requests",
    "baseline_hit_tokens",
    "raykv_hit_tokens",
    "baseline_ttft_p50_ms",
    "raykv_ttft_p50_ms",
    "outputs_match",
}


def test_demo_reports_more_hits_with_raykv_and_identical_outputs(vllm_env) -> None:
    if ray.is_initialized():
        ray.shutdown()
    report = demo(replicas=2, sessions=3, turns=3, show_progress=False)
    print(format_report(report))
    assert KEYS <= report.keys()
    assert report["replicas"] == 2 and report["requests"] == 9
    assert report["raykv_hit_tokens"] > report["baseline_hit_tokens"]
    # round-robin: every later turn's prefix was computed on the other replica
    assert report["raykv_hit_tokens"] == report["oracle_hit_tokens"]
    assert report["outputs_match"] is True
    assert report["directory_keys"] > 0
