"""``raykv bench serve``: its workload, streaming client, statistics, targets and report
(no cluster: the quick run is a Serve test, ``tests/raykv/serve/test_serve_bench.py``)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raykv.bench import serve as bench_serve
from raykv.bench.routing import BLOCK
from raykv.demo import workload
from raykv.ops.cli import build_parser
from tests.benches import check_verdict

# ---------------------------------------------------------------- workload


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _jobs(tokenizer, **kw) -> list[bench_serve.Job]:
    args = dict(prefixes=3, prefix_tokens=600, suffix_tokens=64, prompts=9, sessions=4, turns=3, tenants=2, seed=7)
    args.update(kw)
    return bench_serve.build_jobs(tokenizer, **args)


def test_jobs_share_prefixes_and_sessions_grow(tokenizer) -> None:
    jobs = _jobs(tokenizer)
    prefix = [j for j in jobs if j.kind == "prefix"]
    sessions = [j for j in jobs if j.kind == "session"]
    assert sorted(j.index for j in prefix) == list(range(9)) and sorted(j.index for j in sessions) == list(range(4))
    assert all(len(j.prompts) == len(j.tokens) == 1 for j in prefix)
    assert all(len(j.prompts) == len(j.tokens) == 3 for j in sessions)
    # three prompts per prefix; prompts of one prefix share its leading blocks, and no others do
    for p in range(3):
        mine = [j.tokens[0] for j in prefix if j.group == p]
        assert len(mine) == 3
        assert len({tuple(t[: 4 * BLOCK]) for t in mine}) == 1
        assert len({tuple(t) for t in mine}) == 3  # each has its own suffix
    assert len({tuple(j.tokens[0][:BLOCK]) for j in prefix}) == 3
    for j in sessions:  # each turn's prompt extends the one before
        assert all(j.tokens[t + 1][: len(j.tokens[t]) - 2] == j.tokens[t][:-2] for t in range(2))
        assert all(j.prompts[t + 1].startswith(j.prompts[t]) for t in range(2))
    # the two kinds are mixed, deterministically by the seed
    kinds = [j.kind for j in jobs]
    assert kinds != sorted(kinds) and kinds != sorted(kinds, reverse=True)
    assert [(j.kind, j.index) for j in _jobs(tokenizer)] == [(j.kind, j.index) for j in jobs]
    assert [(j.kind, j.index) for j in _jobs(tokenizer, seed=8)] != [(j.kind, j.index) for j in jobs]


def test_oracle_counts_the_shared_prefixes(tokenizer) -> None:
    only_prefixes = _jobs(tokenizer, sessions=0)
    oracle = bench_serve.oracle_hit_tokens(only_prefixes)
    prefix_blocks = min(len(j.tokens[0]) for j in only_prefixes) // BLOCK
    # every prompt after its prefix's first hits the prefix's full blocks (the block
    # holding the prefix's end may differ, as text tokenizes across the join)
    assert 6 * (prefix_blocks - 1) * BLOCK <= oracle <= 6 * prefix_blocks * BLOCK
    everything = _jobs(tokenizer)
    sent = [t for j in everything for t in j.tokens]
    assert bench_serve.oracle_hit_tokens(everything) == workload.oracle_hit_tokens(
        [workload.TraceRequest(i, 0, 0, 0, t) for i, t in enumerate(sent)], BLOCK
    )
    assert bench_serve.oracle_hit_tokens(everything) > oracle  # sessions add their histories
    with pytest.raises(ValueError, match="--prefixes"):
        _jobs(tokenizer, prefixes=0)


# ---------------------------------------------------------------- streaming client

TOKEN_GAP_S = 0.05
FIRST_TOKEN_S = 0.12


class _SSEHandler(BaseHTTPRequestHandler):
    """An OpenAI-style completions stream: chunked SSE, one token every TOKEN_GAP_S."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "fail" in body["prompt"]:
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")
            return
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["max_tokens"]
        time.sleep(FIRST_TOKEN_S)  # not a wait: a fake server's first-token latency, which the bench measures
        for i in range(n):
            if i:
                time.sleep(TOKEN_GAP_S)  # not a wait: the fake server's pace between tokens
            msg = {"choices": [{"index": 0, "text": f"t{i}"}], "usage": None}
            self._chunk(b"data: " + json.dumps(msg).encode() + b"\n\n")
        usage = {"prompt_tokens": 300, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 256}}
        self._chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


@pytest.fixture(scope="module")
def sse_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    server.shutdown()
    server.server_close()


def test_stream_completion_times_the_stream_as_it_arrives(sse_url) -> None:
    rec = bench_serve.stream_completion(sse_url, {"model": "m", "prompt": "hello", "max_tokens": 5})
    assert rec["prompt_tokens"] == 300 and rec["cached_tokens"] == 256 and rec["output_tokens"] == 5
    # the first token after FIRST_TOKEN_S, the rest TOKEN_GAP_S apart: read as they come, not at the end
    assert FIRST_TOKEN_S <= rec["ttft_ms"] / 1000 < FIRST_TOKEN_S + 3 * TOKEN_GAP_S
    assert TOKEN_GAP_S * 0.9 <= rec["tpot_ms"] / 1000 < TOKEN_GAP_S * 2
    assert rec["e2e_ms"] >= rec["ttft_ms"] + 4 * TOKEN_GAP_S * 1000 * 0.9
    one = bench_serve.stream_completion(sse_url, {"model": "m", "prompt": "hi", "max_tokens": 1})
    assert one["output_tokens"] == 1 and one["tpot_ms"] is None
    with pytest.raises(RuntimeError, match="HTTP 500"):
        bench_serve.stream_completion(sse_url, {"model": "m", "prompt": "fail", "max_tokens": 2})


def test_drive_keeps_turns_in_order_and_counts_failures(sse_url) -> None:
    jobs = [
        bench_serve.Job("session", 0, 0, ["a", "a b", "a b c"], [[], [], []]),
        bench_serve.Job("prefix", 0, 0, ["p0"], [[]]),
        bench_serve.Job("prefix", 1, 0, ["fail"], [[]]),
        bench_serve.Job("session", 1, 1, ["x", "x y"], [[], []]),
    ]

    def send(prompt: str) -> dict:
        return bench_serve.stream_completion(sse_url, {"model": "m", "prompt": prompt, "max_tokens": 2})

    t0 = time.perf_counter()
    records, wall_s, failed = bench_serve.drive(jobs, 2, send)
    assert failed == 1 and len(records) == 6
    assert 0 < wall_s <= time.perf_counter() - t0
    for session in (0, 1):
        mine = sorted((r for r in records if r["kind"] == "session" and r["job"] == session), key=lambda r: r["turn"])
        done = [r["done_s"] for r in mine]
        assert done == sorted(done)
        # a turn starts only once the one before has answered
        assert all(b - a >= b_rec["e2e_ms"] / 1000 * 0.99 for a, b, b_rec in zip(done, done[1:], mine[1:]))
    # two in flight: the 6 requests of ~0.17 s take about 3 rounds, not 6
    assert wall_s < 5.5 * (FIRST_TOKEN_S + TOKEN_GAP_S)


# ---------------------------------------------------------------- statistics and targets


def _records(ttfts: list[float], cached: int = 500, kind: str = "prefix") -> list[dict]:
    return [
        {
            "kind": kind,
            "prompt_tokens": 1000,
            "cached_tokens": cached,
            "output_tokens": 8,
            "ttft_ms": t,
            "e2e_ms": t + 70,
            "tpot_ms": 10.0,
        }
        for t in ttfts
    ]


def test_summary() -> None:
    records = _records([100.0, 200.0, 300.0, 400.0]) + _records([50.0], cached=0, kind="session")
    s = bench_serve.summary(records, wall_s=2.0, oracle=2500, engine_hit=1500, by_source={"device": 1500, "host": 500})
    assert s["requests"] == 5 and s["requests_per_s"] == pytest.approx(2.5)
    assert s["output_tokens_per_s"] == pytest.approx(20.0)
    assert s["ttft_p50_ms"] == 200.0 and s["e2e_p50_ms"] == 270.0 and s["tpot_p50_ms"] == 10.0
    assert s["ttft_p99_ms"] == pytest.approx(396.0)
    assert s["ttft_p50_ms_by_kind"] == {"prefix": 250.0, "session": 50.0}
    assert s["cached_tokens"] == 2000 and s["cached_share"] == pytest.approx(0.4)
    assert (s["engine_hit_tokens"], s["raykv_hit_tokens"], s["recomputed_tokens"]) == (1500, 500, 3000)
    assert s["oracle_share"] == pytest.approx({"engine_hit": 0.6, "raykv_hit": 0.2, "recomputed": 0.2, "hits": 0.8})
    assert s["hit_tokens_by_source"] == {"device": 1500, "host": 500}
    unknown = bench_serve.summary(records, 2.0, 2500, engine_hit=None)
    assert unknown["engine_hit_tokens"] is None and unknown["raykv_hit_tokens"] is None
    assert unknown["oracle_share"]["hits"] == pytest.approx(0.8)
    assert (
        bench_serve.summary([], 0.0, 0, None)["requests_per_s"]
        != bench_serve.summary([], 0.0, 0, None)["requests_per_s"]
    )


def _config(rps: float, ttft: float, tpot: float) -> dict:
    return {"requests_per_s": rps, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}


def test_targets_are_the_issues_with_verdicts_that_agree() -> None:
    configs = {
        "no_raykv": _config(8.0, 400.0, 10.0),
        "prefix_affinity": _config(9.0, 300.0, 10.0),
        "raykv_tiers": _config(7.0, 300.0, 12.0),
        "raykv": _config(10.0, 260.0, 10.5),
    }
    out = {t["target"]: t for t in bench_serve.targets(configs)}
    assert out["requests/s, raykv router + tiers / no raykv"]["value"] == pytest.approx(1.25)
    assert out["requests/s, raykv router + tiers / no raykv"]["passed"] is True
    assert out["TTFT p50, raykv router + tiers / no raykv"]["value"] == pytest.approx(0.65)
    assert out["TTFT p50, raykv router + tiers / no raykv"]["passed"] is True
    assert out["requests/s, raykv router + tiers / prefix-affinity"]["passed"] is True
    ttft_affinity = out["TTFT p50, raykv router + tiers / prefix-affinity"]
    assert ttft_affinity["value"] == pytest.approx(260 / 300) and ttft_affinity["passed"] is True
    assert out["TPOT p50, raykv router + tiers / no raykv"]["passed"] is True
    tiers_tpot = out["TPOT p50, raykv tiers (default router) / no raykv"]
    assert tiers_tpot["value"] == pytest.approx(1.2) and tiers_tpot["passed"] is False
    for t in out.values():
        check_verdict(t)
    # a configuration that failed or did not run drops the targets it is in
    configs["prefix_affinity"] = {"error": "TimeoutError: no app"}
    del configs["raykv_tiers"]
    names = [t["target"] for t in bench_serve.targets(configs)]
    assert not any("prefix-affinity" in n or "default router" in n for n in names) and len(names) == 3
    # a ratio that cannot be measured is not a verdict
    configs["no_raykv"]["tpot_p50_ms"] = float("nan")
    (tpot,) = [t for t in bench_serve.targets(configs) if t["target"].startswith("TPOT")]
    assert tpot["value"] is None and tpot["passed"] is None


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *argv])


def test_options() -> None:
    from raykv.bench.common import fill_defaults

    args = _args()
    fill_defaults(args, bench_serve.FULL, bench_serve.QUICK)
    assert (args.replicas, args.concurrency, args.output_tokens) == (3, 4, 8)
    assert (args.prefixes, args.prefix_tokens, args.suffix_tokens, args.prompts) == (12, 1000, 64, 120)
    # --quick's values, but for an option given on the command line
    quick = _args("--quick", "--replicas", "4")
    fill_defaults(quick, bench_serve.FULL, bench_serve.QUICK)
    assert (quick.replicas, quick.concurrency, quick.prefix_tokens) == (4, 2, 300)
    assert bench_serve._configs(args) == list(bench_serve.CONFIGS)
    assert _args("--concurrency", "16").concurrency == 16
    assert bench_serve._configs(_args("--configs", "no_raykv,raykv")) == ["no_raykv", "raykv"]
    with pytest.raises(ValueError, match="--configs"):
        bench_serve._configs(_args("--configs", "no_raykv,fast"))


def test_report() -> None:
    records = _records([100.0, 200.0])
    ok = bench_serve.summary(records, 1.0, 1000, 600, {"device": 600, "disk": 400})
    ok["cascade_dropped_blocks"] = 3
    ok["cpu_s_per_request"] = {"engines": 0.0425, "holder actors": 0.002}
    configs = {
        "no_raykv": bench_serve.summary(records, 1.0, 1000, 1000),
        "raykv": ok,
        "prefix_affinity": {"error": "X: y"},
    }
    result = {
        "model": "tiny",
        "replicas": 2,
        "concurrency": 4,
        "output_tokens": 8,
        "workload": {
            "prefixes": 2,
            "prefix_tokens": 300,
            "suffix_tokens": 64,
            "prompts": 4,
            "sessions": 2,
            "turns": 2,
            "tenants": 2,
        },
        "requests": 8,
        "engine_blocks": 24,
        "primary_chunks": 96,
        "oracle_hit_tokens": 1000,
        "configs": configs,
        "targets": bench_serve.targets(configs),
    }
    text = bench_serve.format_result(result)
    assert "the oracle hits 1000 tokens" in text and "CPU primary 96 chunks" in text
    row = next(line for line in text.splitlines() if line.startswith("raykv ") and "bench serve" not in line)
    assert "60% / 40%" in row and row.rstrip().endswith("3")
    assert "failed: X: y" in text and "Targets" in text
    assert "  raykv: engines 42.5, holder actors 2.0" in text.splitlines()
    assert "no_raykv = no raykv: Serve's default router, vLLM with no offload" in text


def test_no_raykv_app_has_no_connector(tiny_model) -> None:
    pytest.importorskip("ray.serve.llm")
    from raykv.serve import llm_config

    plain = llm_config(tiny_model, model_id="m", raykv=False, accelerator="cpu")
    assert "kv_transfer_config" not in plain.engine_kwargs and "kv_events_config" not in plain.engine_kwargs
    attached = llm_config(tiny_model, model_id="m", accelerator="cpu")
    assert attached.engine_kwargs["kv_transfer_config"]
    affinity = llm_config(tiny_model, raykv=False, router="prefix_affinity", accelerator="cpu")
    assert "kv_transfer_config" not in affinity.engine_kwargs
    with pytest.raises(ValueError, match="raykv=False"):
        llm_config(tiny_model, raykv=False, router="raykv", accelerator="cpu")
    with pytest.raises(ValueError, match="raykv=False"):
        llm_config(tiny_model, raykv=False, engine_cache=True, accelerator="cpu")
