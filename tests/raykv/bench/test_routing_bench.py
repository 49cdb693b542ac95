"""``raykv bench routing``'s trace oracle, options and report (no cluster: the full run is a benchmark)."""

from __future__ import annotations

import argparse

import pytest

from raykv.bench import routing
from raykv.demo import workload
from raykv.demo.replicas import deployment_primary_chunks
from raykv.ops.cli import build_parser


@pytest.fixture(scope="module")
def sessions(tiny_model) -> list[routing.Session]:
    from transformers import AutoTokenizer

    return routing.build_sessions(8, 3, 3, AutoTokenizer.from_pretrained(tiny_model))


def _oracle(prompts: list[list[int]]) -> int:
    trace = [workload.TraceRequest(i, 0, 0, 0, p) for i, p in enumerate(prompts)]
    return workload.oracle_hit_tokens(trace, routing.BLOCK)


def test_oracle_is_the_workload_rule_over_the_sent_prompts(sessions) -> None:
    oracle = routing.oracle_hit_tokens(sessions)
    sent = [t for s in sorted(sessions, key=lambda s: s.late) for t in s.tokens]
    assert oracle == _oracle(sent)
    # Concurrent sessions interleave differently per router: the oracle does not move.
    turn_major = [s.tokens[t] for t in range(3) for s in sessions]
    assert oracle == _oracle(list(reversed([s.tokens[0] for s in sessions])) + turn_major[len(sessions) :])
    assert oracle == _oracle(turn_major)
    # It counts later turns' histories and the tenants' shared system prompts,
    # and never more than the prompts' full blocks short of their last token.
    later_turns = sum(_oracle(s.tokens) for s in sessions)
    assert later_turns > 0 and oracle > later_turns
    assert oracle <= sum((len(t) - 1) // routing.BLOCK * routing.BLOCK for s in sessions for t in s.tokens)


def test_oracle_share() -> None:
    share = routing.oracle_share(engine_hit=600, raykv_hit=300, oracle=1000)
    assert share == pytest.approx({"engine_hit": 0.6, "raykv_hit": 0.3, "recomputed": 0.1, "hits": 0.9})
    assert all(v != v for v in routing.oracle_share(0, 0, 0).values())  # no oracle hits: not a number


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "routing", *argv])


def test_primary_chunks_default_is_the_deployment_rule() -> None:
    assert routing.primary_chunks(_args()) == deployment_primary_chunks(routing.ENGINE_BLOCKS)
    assert routing.primary_chunks(_args("--primary-chunks", "64")) == 64
    with pytest.raises(ValueError, match="--primary-chunks"):
        routing.primary_chunks(_args("--primary-chunks", "0"))


def test_report_shows_oracle_shares_and_drops() -> None:
    r = {
        "engine_hit_tokens": 600,
        "raykv_hit_tokens": 300,
        "recomputed_tokens": 2000,
        "prompt_tokens": 2900,
        "oracle_share": routing.oracle_share(600, 300, 1000),
        "cascade_dropped_blocks": 7,
        "ttft_p50_ms": 40.0,
        "ttft_p99_ms": 90.0,
        "requests_per_s": 3.0,
        "max_load_share": 1.2,
        "requests_per_replica": [5, 4],
        "unattributed_requests": 0,
        "requests": [],
    }
    per = {"default": r, "raykv": {"error": "TimeoutError: no app"}}
    result = {
        "replicas": 2,
        "sessions": 4,
        "turns": 2,
        "tenants": 3,
        "concurrency": 2,
        "requests": 8,
        "model": "tiny",
        "engine_blocks": routing.ENGINE_BLOCKS,
        "primary_chunks": 96,
        "oracle_hit_tokens": 1000,
        "routers": per,
        "targets": routing._targets(per),
    }
    text = routing.format_result(result)
    assert "the oracle hits 1000 tokens" in text and "CPU primary 96 chunks" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("default"))
    assert "60%" in row and "30%" in row and "10%" in row and " 7 " in row
    assert "failed: TimeoutError" in text
    (hits,) = [t for t in result["targets"] if "oracle" in t["target"]]
    assert hits["value"] == pytest.approx(0.9) and hits["passed"] is True


def test_decision_quantiles_come_from_the_histogram_buckets() -> None:
    inf = float("inf")
    before = routing.RouterTotals(1.0, 5, {}, {0.001: 1, 0.0025: 3, 0.005: 5, inf: 5})
    after = routing.RouterTotals(2.0, 15, {}, {0.001: 3, 0.0025: 11, 0.005: 15, inf: 15})
    # 10 new decisions: 2 at <= 1 ms, 6 in (1, 2.5] ms, 2 in (2.5, 5] ms
    assert routing.decision_quantile_ms(before, after, 0.5) == pytest.approx(1.0 + 1.5 * 3 / 6)
    assert routing.decision_quantile_ms(before, after, 0.99) == pytest.approx(2.5 + 2.5 * 1.9 / 2)
    assert routing.decision_quantile_ms(after, after, 0.5) is None  # no decision in between


def test_decision_cpu_is_per_decision_between_reads() -> None:
    before = routing.RouterTotals(1.0, 5, {}, {}, cpu_seconds=0.004)
    after = routing.RouterTotals(2.0, 15, {}, {}, cpu_seconds=0.009)
    assert routing.decision_cpu_ms(before, after) == pytest.approx(0.5)
    assert routing.decision_cpu_ms(after, after) is None


def test_router_options_are_checked_numbers() -> None:
    assert routing.router_options(["load_weight=0.25", "min_queue_gap=3"]) == {"load_weight": 0.25, "min_queue_gap": 3}
    assert routing.router_options([]) == {}
    for bad in (["load_weight"], ["no_such=1"], ["load_weight=much"]):
        with pytest.raises(ValueError, match="--router-option"):
            routing.router_options(bad)
    args = _args("--router-option", "load_weight=0.1", "--router-option", "max_load_share=2")
    assert routing.router_options(args.router_option) == {"load_weight": 0.1, "max_load_share": 2.0}


def _record(session: int, turn: int, replica: str | None) -> routing.RequestRecord:
    return {
        "session": session,
        "turn": turn,
        "replica": replica,
        "prompt_tokens": 512,
        "cached_tokens": 256 if turn else 0,
        "engine_hit_tokens": 256 if turn else 0,
        "ttft_ms": 100.0,
        "at": 1.0 + turn,
    }


def test_a_replica_left_idle_counts_in_the_load_share() -> None:
    """Seen in a run: prefix affinity sent 18 requests to each of two replicas and none to
    the third; over the two it used, it looked perfectly balanced (1.00)."""
    results = [_record(s, t, "ra" if s % 2 else "rb") for s in range(6) for t in range(3)]
    three = routing._summary(results, oracle=2048, replicas=3)
    assert three["requests_per_replica"] == [9, 9, 0]
    assert three["max_load_share"] == pytest.approx(1.5)
    assert routing._summary(results, oracle=2048, replicas=2)["max_load_share"] == pytest.approx(1.0)
    # every request, in the order answered, with its session's turn
    assert [(r["session"], r["turn"]) for r in three["requests"]] == [(s, t) for s in range(6) for t in range(3)]
    assert three["engine_hit_tokens"] == 6 * 2 * 256


def _sent(
    session: int, turn: int, replica: str, cached: int, engine: int, sent: float, ttft_ms: float
) -> routing.RequestRecord:
    return {
        "session": session,
        "turn": turn,
        "replica": replica,
        "prompt_tokens": 0,
        "cached_tokens": cached,
        "engine_hit_tokens": engine,
        "ttft_ms": ttft_ms,
        "sent": sent,
        "at": sent + ttft_ms / 1000,
    }


def test_a_hit_only_its_own_engine_could_have_served_counts_as_the_engines(sessions) -> None:
    """Sessions 0 and 3 share tenant 0's 3-block system prompt. Sent together to one
    replica, the second's 384 cached tokens were counted as raykv's: the directory did
    not list the first's blocks yet when the bench read it, before sending."""
    by_index = {s.index: s for s in sessions}
    assert routing.leading_blocks_shared(by_index[0].tokens[0], by_index[3].tokens[0]) == 3
    assert routing.leading_blocks_shared(by_index[0].tokens[0], by_index[1].tokens[0]) == 0  # other tenant
    results = [
        _sent(0, 0, "C", cached=0, engine=0, sent=0.01, ttft_ms=1280),
        _sent(3, 0, "C", cached=384, engine=0, sent=0.01, ttft_ms=1270),  # a chunk after s0's on C
        _sent(6, 0, "B", cached=384, engine=0, sent=1.0, ttft_ms=900),  # tenant 0 on another replica: raykv's
        _sent(0, 1, "A", cached=640, engine=0, sent=1.5, ttft_ms=500),  # s0's history, on another replica
        _sent(1, 0, "C", cached=0, engine=0, sent=0.0, ttft_ms=2000),  # another tenant: shares nothing
    ]
    routing.credit_same_engine(results, sessions)
    assert [r["engine_hit_tokens"] for r in results] == [0, 384, 0, 0, 0]
    # Another replica's copy of the same blocks could have been in raykv before it answered:
    # the directory's reading stands.
    raced = [
        _sent(0, 0, "C", cached=0, engine=0, sent=0.01, ttft_ms=1280),
        _sent(6, 0, "B", cached=0, engine=0, sent=0.0, ttft_ms=600),
        _sent(3, 0, "C", cached=384, engine=0, sent=0.3, ttft_ms=1000),
    ]
    routing.credit_same_engine(raced, sessions)
    assert raced[2]["engine_hit_tokens"] == 0
    # Unless the same engine had them before it was sent (answered 10 ms before: its events
    # were not in the directory yet): the engine's cache comes first.
    raced[0]["ttft_ms"] = 280
    routing.credit_same_engine(raced, sessions)
    assert raced[2]["engine_hit_tokens"] == 384
    # Answered well before it was sent: the directory listed those blocks by then (or the
    # engine evicted them), so the directory's reading stands; and never more than cached.
    old = [
        _sent(0, 0, "C", cached=0, engine=0, sent=0.0, ttft_ms=500),
        _sent(3, 0, "C", cached=384, engine=0, sent=0.5 + routing.EVENT_LAG_S + 0.1, ttft_ms=500),
    ]
    routing.credit_same_engine(old, sessions)
    assert old[1]["engine_hit_tokens"] == 0
    old[1]["sent"], old[1]["cached_tokens"] = 1.0, 256
    routing.credit_same_engine(old, sessions)
    assert old[1]["engine_hit_tokens"] == 256
