"""Removed block files are counted and named in the log, never hidden by the rate limit."""

from __future__ import annotations

import logging

import pytest

from raykv.metrics.incidents import Removal, RemovalLog
from tests.waiting import wait_until


def _removals(n: int, tag: str = "k") -> list[Removal]:
    return [Removal(f"{tag}{i:04d}", f"/kv/{tag}{i:04d}.blk", "checksum mismatch") for i in range(n)]


def _named(records: list[logging.LogRecord], removal: Removal) -> int:
    return sum(removal.key in r.getMessage() and removal.path in r.getMessage() for r in records)


def test_a_burst_names_every_file_once(caplog: pytest.LogCaptureFixture) -> None:
    log = RemovalLog("fs root /kv", {"tier": "fs", "node": "shared", "holder": "fs:x"}, period_s=0.3, burst=3)
    first, second = _removals(5), _removals(4, "j")
    with caplog.at_level(logging.WARNING, logger="raykv.metrics.incidents"):
        log.note("corrupt", first)  # 3 at once, 2 wait for the period's end
        log.note("corrupt", second)  # all 4 wait
        log.note("missing", _removals(1, "m"))  # its own reason: logged at once
        at_once = list(caplog.records)
        assert len(at_once) == 4 and all("removed corrupt block file" in r.getMessage() for r in at_once[:3])
        wait_until(
            lambda: len(caplog.records) != len(at_once),
            timeout_s=5,
            interval_s=0.05,
            what="the timer to log the summary",
        )
        log.close()
    records = list(caplog.records)
    assert [_named(records, r) for r in first + second] == [1] * 9  # every file exactly once
    summary = [r.getMessage() for r in records if "removed in the last" in r.getMessage()]
    assert len(summary) == 1 and summary[0].startswith("fs root /kv: 6 corrupt block files removed"), summary
    assert "checksum mismatch" in summary[0]
    assert log.totals == {"corrupt": 9, "missing": 1}


def test_long_summaries_are_split_and_still_name_every_file(caplog: pytest.LogCaptureFixture) -> None:
    log = RemovalLog("fs root /kv", {"tier": "fs", "node": "shared", "holder": "fs:x"}, burst=0, per_summary=10)
    files = _removals(25)
    with caplog.at_level(logging.WARNING, logger="raykv.metrics.incidents"):
        log.note("corrupt", files)
        assert not caplog.records  # burst 0: all wait
        log.close()
    assert len(caplog.records) == 3 and "[21-25 of 25]" in caplog.records[-1].getMessage()
    assert [_named(caplog.records, r) for r in files] == [1] * 25
