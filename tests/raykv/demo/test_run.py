"""`raykv demo` end to end (real vLLM replicas on a two-node local Ray), shortened."""

from __future__ import annotations

import pytest
import ray

from raykv.demo.run import demo, format_report, passed

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KEYS = {
    "replicas",
    "requests",
    "baseline_hit_tokens",
    "raykv_hit_tokens",
    "baseline_ttft_p50_ms",
    "raykv_ttft_p50_ms",
    "outputs_match",
}


def test_demo_reports_more_hits_with_raykv_and_identical_outputs(vllm_env, tiny_model) -> None:
    if ray.is_initialized():
        ray.shutdown()
    # one request at a time, each waiting for its offloads: the hit count is exact
    report = demo(replicas=2, sessions=3, turns=3, model=tiny_model, show_progress=False, concurrency=0)
    text = format_report(report)
    print(text)
    assert KEYS <= report.keys()
    assert report["replicas"] == 2 and report["requests"] == 9
    assert report["raykv_hit_tokens"] > report["baseline_hit_tokens"]
    # round-robin: every later turn's prefix was computed on the other replica
    assert report["raykv_hit_tokens"] == report["oracle_hit_tokens"]
    assert report["outputs_match"] is True
    assert report["directory_keys"] > 0
    # the correctness line names the largest difference and the tolerance it was held to
    assert report["outputs"]["requests"] == 9 and report["outputs"]["max_logprob_diff"] >= 0
    assert "largest logprob difference" in text and "eps(bfloat16)" in text
    # a prefix loaded from raykv gives the engine's own bits at the same split
    probe = report["exact_probe"]
    assert probe["raykv_cached_tokens"] == probe["engine_cached_tokens"] == 1024
    assert probe["bit_exact"] is True and passed(report)
