"""tiers.object_store.timings: recent durations, and slow loads logged with their phases."""

from __future__ import annotations

import logging

import pytest

from tiers.object_store.timings import SLOW_LOAD_S, Timings, slow_load


def test_medians_per_operation() -> None:
    t = Timings(("load", "store"))
    for s in (0.001, 0.003, 0.002):
        t.add("load", s)
    assert t.median_ms() == {"load_ms_p50": pytest.approx(2.0), "store_ms_p50": 0.0}


def test_a_slow_load_is_logged_with_where_its_time_went(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiers.object_store.timings"):
        assert not slow_load(1, 16, 2, 0, SLOW_LOAD_S / 2, [("find", 0.001)])
        assert not caplog.records
        assert slow_load(7, 16, 1, 1, 31.0, [("find", 0.5), ("get local", 0.01), ("pull", 30.0)])
    (rec,) = caplog.records
    assert "job 7" in rec.getMessage() and "pull 30.00 s" in rec.getMessage() and "31.0 s" in rec.getMessage()
