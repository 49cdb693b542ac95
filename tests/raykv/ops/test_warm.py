"""``raykv warm`` without Ray or vLLM: prompt files, the TTL check, waiting for
pins to settle, the report, the requests it sends (to a stub HTTP app), and
bad input as one line with exit code 2."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from raykv.core.pins import TIER_CAP
from raykv.core.validate import ConfigError
from raykv.ops import cli, warm
from raykv.ops.pin_watch import NOTHING_NEW, SETTLED, TIMED_OUT, PinCount, Settling, growth, wait_settled
from raykv.ops.prompt_file import parse_prompts, read_prompts
from tiers.object_store.all_nodes import NO_ACTOR, Replication
from tiers.object_store.messages import ReplicateAnswer

# -- prompt files -------------------------------------------------------------------


def test_prompt_lines_are_text_json_strings_or_token_ids() -> None:
    lines = ["You are a helpful agent.\n", "\n", '  "line one\\nline two"\n', "[1, 2, 3]\r\n", "   \n", "a [b] c"]
    assert parse_prompts(lines) == ["You are a helpful agent.", "line one\nline two", [1, 2, 3], "a [b] c"]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[1, 2", "prompts:1: not valid JSON"),
        ('"unterminated', "prompts:1: not valid JSON"),
        ("[]", "prompts:1: a token-id line must be a non-empty JSON list of integers"),
        ('[{"a": 1}]', "prompts:1: token ids must be integers >= 0"),
        ("[1, -2]", "prompts:1: token ids must be integers >= 0"),
        ("[1, true]", "prompts:1: token ids must be integers >= 0"),
        ('""', "prompts:1: an empty prompt"),
    ],
)
def test_bad_prompt_lines_name_the_line(line: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why.replace("[", r"\[")):
        parse_prompts([line])


def test_no_prompts_or_no_file_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match="empty.txt: no prompts"):
        read_prompts(str(empty))
    with pytest.raises(ConfigError, match="--prompt-file: cannot read .*missing.txt"):
        read_prompts(str(tmp_path / "missing.txt"))
    good = tmp_path / "good.txt"
    good.write_text("first\n[7, 8]\n")
    assert read_prompts(str(good)) == ["first", [7, 8]]


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), 8 * 24 * 3600.0, True])
def test_bad_ttl(ttl: float) -> None:
    with pytest.raises(ConfigError, match="--ttl"):
        warm.check_ttl(ttl)


def test_ttl_ok() -> None:
    assert warm.check_ttl(600) == 600.0


# -- waiting for pins ---------------------------------------------------------------


def _pins(os_blocks: int, fs_blocks: int = 0) -> dict[str, PinCount]:
    return {
        "object_store:n1": PinCount("object_store:n1", "object_store", "n1", os_blocks, os_blocks * 10),
        "fs:/r": PinCount("fs:/r", "fs", None, fs_blocks, fs_blocks * 10),
    }


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _wait(readings: list[dict[str, PinCount]], settling: Settling) -> tuple[dict[str, PinCount], str, float]:
    clock = FakeClock()
    it = iter(readings)
    last: list[dict[str, PinCount]] = []

    def read() -> dict[str, PinCount]:
        last[:] = [next(it, last[0] if last else readings[-1])]
        return last[0]

    pins, ended = wait_settled(read, _pins(0), settling, clock, clock.sleep)
    return pins, ended, clock.now


def test_wait_settles_once_pins_stop_growing() -> None:
    settling = Settling(settle_s=1.0, quiet_s=5.0, limit_s=30.0, interval_s=0.5)
    pins, ended, t = _wait([_pins(0), _pins(3), _pins(7), _pins(7, 2), _pins(7, 7)], settling)
    assert ended == SETTLED and pins == _pins(7, 7)
    assert t == pytest.approx(2.0 + 1.0)  # the last change at 2.0 s, then 1 s unchanged


def test_wait_gives_up_when_nothing_is_pinned_or_at_the_limit() -> None:
    pins, ended, t = _wait([_pins(0)], Settling(settle_s=1.0, quiet_s=5.0, limit_s=30.0, interval_s=0.5))
    assert ended == NOTHING_NEW and t == pytest.approx(5.0)
    growing = [_pins(i) for i in range(100)]
    pins, ended, t = _wait(growing, Settling(settle_s=1.0, quiet_s=5.0, limit_s=10.0, interval_s=0.5))
    assert ended == TIMED_OUT and t == pytest.approx(10.0) and pins == _pins(20)


def test_growth_counts_new_holders_whole() -> None:
    before = {"object_store:n1": PinCount("object_store:n1", "object_store", "n1", 2, 20)}
    assert growth(before, _pins(5, 4)) == _pins(3, 4) | {
        "object_store:n1": PinCount("object_store:n1", "object_store", "n1", 3, 30)
    }


# -- the report ---------------------------------------------------------------------


def _warmed() -> warm.Warmed:
    out = warm.Warmed("tiny", 600.0, "agents", [warm.Answered(1001, 0, 1.25), warm.Answered(300, 256, 0.5)])
    out.pinned = {
        "object_store:n1": PinCount("object_store:n1", "object_store", "n1", 7, 7 << 17),
        "object_store:n2": PinCount("object_store:n2", "object_store", "n2", 0, 0),
        "fs:/r": PinCount("fs:/r", "fs", None, 9, 9 << 17),
    }
    out.ended = SETTLED
    return out


def test_report_json_and_text() -> None:
    out = _warmed()
    report = out.report()
    assert json.loads(json.dumps(report)) == report
    assert report["blocks_pinned"] == 16 and report["bytes_pinned"] == 16 << 17
    assert report["per_tier"] == {
        "fs": {"blocks": 9, "bytes": 9 << 17},
        "object_store": {"blocks": 7, "bytes": 7 << 17},
    }
    assert report["prompts"][1] == {"prompt_tokens": 300, "cached_tokens": 256, "seconds": 0.5}
    assert [h["holder_id"] for h in report["per_holder"]] == ["fs:/r", "object_store:n1", "object_store:n2"]
    text = out.format()
    assert text.splitlines()[0] == (
        "warmed 2 prompts (1301 tokens) on tiny, ttl 600 s, tenant 'agents': 16 blocks, 2.0 MiB newly pinned (settled)"
    )
    assert "  fs                  9 blocks" in text and "  object_store        7 blocks" in text
    assert "object_store:n2" in text and "no new pins" not in text
    out.ended = NOTHING_NEW
    assert "no new pins" in out.format()


def test_report_of_all_nodes() -> None:
    out = _warmed()
    assert out.report()["all_nodes"] is None and "all nodes" not in out.format()
    out.replicated = Replication("agents", 600.0, keys=7)
    out.replicated.per_node = {
        "n1": ReplicateAnswer("n1", held=7, pinned=7),
        "n2": ReplicateAnswer("n2", copied=7, copied_bytes=7 << 17, pinned=5, pins_refused={TIER_CAP: 2}),
        "n3": ReplicateAnswer("n3", not_stored=7, error="no room"),
    }
    out.replicated.errors = {"n4": NO_ACTOR}
    report = out.report()
    assert json.loads(json.dumps(report)) == report
    all_nodes = report["all_nodes"]
    assert all_nodes["keys"] == 7 and all_nodes["blocks_copied"] == 7 and all_nodes["bytes_copied"] == 7 << 17
    assert [n["node_id"] for n in all_nodes["per_node"]] == ["n1", "n2", "n3"]
    assert all_nodes["per_node"][1]["pins_refused"] == {TIER_CAP: 2} and all_nodes["errors"] == {"n4": NO_ACTOR}
    lines = out.format().splitlines()
    assert "  all nodes: 7 pinned blocks sent to 4 nodes' object stores; 7 blocks, 896.0 KiB copied" in lines
    assert "    node n1: copied 0 (0 B), already there 7, not found 0" in lines
    assert "    node n2: copied 7 (896.0 KiB), already there 0, not found 0, pin refused (tier_cap) 2" in lines
    assert "    node n3: copied 0 (0 B), already there 0, not found 0, not stored 7 (no room)" in lines
    assert f"    node n4: not reached ({NO_ACTOR})" in lines
    out.replicated = Replication("agents", 600.0)
    assert "nothing copied" in out.format()


# -- against a stub app -------------------------------------------------------------


class StubApp(BaseHTTPRequestHandler):
    """/v1/models lists ``models``; /v1/completions records the body and answers usage."""

    models: list[str] = ["tiny"]
    status = 200
    bodies: list[dict[str, Any]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, obj: object) -> None:
        data = json.dumps(obj).encode() if self.status == 200 else b"upstream exploded\n  badly"
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"data": [{"id": m} for m in self.models]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        n = len(body["prompt"]) if isinstance(body["prompt"], list) else 5
        self._answer({"usage": {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}})


@pytest.fixture
def stub_app() -> Iterator[str]:
    StubApp.models, StubApp.status, StubApp.bodies = ["tiny"], 200, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_warm_sends_one_pinning_request_per_prompt_and_reports_the_increase(stub_app, monkeypatch) -> None:
    readings = iter([_pins(1), _pins(1), _pins(4, 4)])
    monkeypatch.setattr(warm, "read_pins", lambda services: next(readings, _pins(4, 4)))
    settling = Settling(settle_s=0.05, quiet_s=5.0, limit_s=5.0, interval_s=0.01)
    out = warm.warm(object(), ["hello", [1, 2, 3]], 60, url=stub_app, tenant="agents", settling=settling)  # type: ignore[arg-type]
    assert [b["prompt"] for b in StubApp.bodies] == ["hello", [1, 2, 3]]
    for body in StubApp.bodies:
        assert body["model"] == "tiny" and body["max_tokens"] == 1
        assert body["kv_transfer_params"] == {"cache_ttl_s": 60.0, "tenant": "agents"}
    assert out.ended == SETTLED and out.blocks_pinned == 3 + 4
    assert [a.prompt_tokens for a in out.answers] == [5, 3]
    warm.warm(object(), ["x"], 5, url=stub_app, settling=settling)  # type: ignore[arg-type]
    assert StubApp.bodies[-1]["kv_transfer_params"] == {"cache_ttl_s": 5.0}


def test_warm_refuses_a_namespace_without_pinning_tiers(stub_app, monkeypatch) -> None:
    monkeypatch.setattr(warm, "read_pins", lambda services: {})

    class Services:
        namespace = "elsewhere"

    with pytest.raises(warm.RaykvError, match="no tier actor that keeps pins .* namespace 'elsewhere'"):
        warm.warm(Services(), ["x"], 5, url=stub_app)  # type: ignore[arg-type]
    assert StubApp.bodies == []


def test_warm_all_nodes_refuses_a_namespace_without_object_store_actors(stub_app, monkeypatch) -> None:
    fs_only = {"fs:/r": PinCount("fs:/r", "fs", None, 0, 0)}
    monkeypatch.setattr(warm, "read_pins", lambda services: fs_only)

    class Services:
        namespace = "fs-only"

    with pytest.raises(warm.RaykvError, match="--all-nodes .* namespace 'fs-only' has no object_store tier actor"):
        warm.warm(Services(), ["x"], 5, url=stub_app, all_nodes=True)  # type: ignore[arg-type]
    assert StubApp.bodies == []


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["warm", *args])
    return code, capsys.readouterr().err.strip()


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, stub_app, capsys, free_port) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    common = ["--prompt-file", str(prompts), "--url", stub_app]
    cases = [
        (["--prompt-file", str(empty), "--ttl", "60"], f"raykv: error: {empty}: no prompts"),
        ([*common, "--ttl", "0"], "raykv: error: --ttl: must be a number of seconds > 0, got 0.0"),
        ([*common, "--ttl", "1e9"], "raykv: error: --ttl: at most 604800 s (7 days)"),
        ([*common, "--ttl", "60", "--model", "big"], "raykv: error: --model: "),
        (
            ["--prompt-file", str(prompts), "--ttl", "60", "--url", f"http://127.0.0.1:{free_port()}"],
            "raykv: error: cannot reach the Serve app at http://127.0.0.1:",
        ),
    ]
    for args, start in cases:
        code, err = _cli(capsys, *args)
        assert code == 2 and err.startswith(start) and "\n" not in err, (args, err)
    StubApp.status = 500
    code, err = _cli(capsys, *common, "--ttl", "60")
    assert code == 2 and err == f"raykv: error: {stub_app}/v1/models answered HTTP 500: upstream exploded badly"
    with pytest.raises(SystemExit) as exit_info:  # argparse's own errors exit 2 too
        cli.main(["warm", *common, "--ttl", "abc"])
    assert exit_info.value.code == 2 and "--ttl: invalid float value: 'abc'" in capsys.readouterr().err
