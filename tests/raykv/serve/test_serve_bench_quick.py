"""``raykv bench serve --quick --json`` end to end: Serve LLM apps (tiny model, two
replicas on two simulated nodes) driven by the streaming client; every key is
reported and every target's verdict agrees with its value. No timing is asserted.

CI runs two of the four configurations: ``raykv`` (raykv's router and tiers) and
``prefix_affinity`` (Ray's router, no raykv), the pair of issue 24's TTFT line. Each
configuration is a Serve app of its own (about 2 minutes of replica start-ups here);
``raykv_tiers`` (Serve's default router with raykv tiers) runs in tests/raykv/serve/test_app.py,
``no_raykv`` is vLLM alone, and the targets over all four are tested on their figures in
tests/raykv/bench/test_serve_bench.py."""

from __future__ import annotations

import pytest

from raykv.bench.serve import CONFIGS
from tests.benches import check_verdict, run_bench

pytestmark = [pytest.mark.serve, pytest.mark.slow]

CONFIG_KEYS = (
    "requests",
    "wall_s",
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "cached_share",
    "engine_hit_tokens",
    "raykv_hit_tokens",
    "recomputed_tokens",
    "hit_tokens_by_source",
    "oracle_share",
    "ttft_p50_ms_by_kind",
    "router",
    "raykv",
    "metrics_cached_tokens",
)
TOP_KEYS = (
    "benchmark",
    "machine",
    "model",
    "replicas",
    "concurrency",
    "output_tokens",
    "workload",
    "requests",
    "engine_blocks",
    "primary_chunks",
    "cpu_bytes",
    "oracle_hit_tokens",
    "configs",
    "targets",
)


@pytest.mark.timeout(2400)
def test_bench_serve_quick_json(vllm_env) -> None:
    pytest.importorskip("ray.serve.llm")
    configs = ("prefix_affinity", "raykv")
    out = run_bench("serve", "--quick", "--configs", ",".join(configs), timeout=2300)
    assert [k for k in TOP_KEYS if k not in out] == []
    assert out["benchmark"] == "serve" and out["model"] == "tiny" and out["replicas"] == 2
    assert out["oracle_hit_tokens"] > 0
    assert set(out["configs"]) == set(configs)
    for name, c in out["configs"].items():
        assert "error" not in c, (name, c)
        assert [k for k in CONFIG_KEYS if k not in c] == [], name
        assert c["requests"] == out["requests"], name
        assert c["output_tokens"] == out["requests"] * out["output_tokens"], name  # ignore_eos: every token
        for k in ("requests_per_s", "ttft_p50_ms", "e2e_p50_ms", "tpot_p50_ms"):
            assert c[k] is not None and c[k] > 0, (name, k, c[k])
        assert c["ttft_p99_ms"] >= c["ttft_p50_ms"] and c["e2e_p50_ms"] >= c["ttft_p50_ms"], name
        # hits by source come from vLLM's own counters and add up to what the client was told
        assert c["metrics_cached_tokens"] == c["cached_tokens"], (name, c["hit_tokens_by_source"])
        assert c["engine_hit_tokens"] + c["raykv_hit_tokens"] == c["cached_tokens"], name
        assert c["prompt_tokens"] == c["cached_tokens"] + c["recomputed_tokens"], name
        assert c["raykv"] == CONFIGS[name][1] and c["router"] == CONFIGS[name][0], name
        if not c["raykv"]:
            assert c["raykv_hit_tokens"] == 0, name  # no connector: every hit is the engine's own
        else:
            assert c["cascade_dropped_blocks"] >= 0, name
            # raykv's holder actors worked for this config's requests
            assert c["cpu_s_per_request"].get("holder actors", 0) > 0, (name, c["cpu_s_by_role"])
        # the engines (Serve replicas and vLLM's processes) did the work
        assert c["cpu_s_per_request"].get("engines", 0) > 0, (name, c["cpu_s_by_role"])
    assert out["configs"]["raykv"]["router_ms_per_request"] is not None
    names = [t["target"] for t in out["targets"]]
    assert names == [  # the two lines of these configs (all six: test_serve_bench.py)
        "requests/s, raykv router + tiers / prefix-affinity",
        "TTFT p50, raykv router + tiers / prefix-affinity",
    ], names
    for t in out["targets"]:  # each verdict agrees with its own figures
        check_verdict(t)
