"""``raykv bench view-reads``: both modes read a live, growing view (no timing is asserted)."""

from __future__ import annotations

from tests.benches import check_verdict, run_bench


def test_view_reads_reads_a_growing_view_in_both_modes() -> None:
    out = run_bench("view-reads", "--seconds", "0.5", "--busy", "0", timeout=120)
    assert out["bench"] == "view-reads"
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"naps", "yields"}
    assert rows["naps"]["nap_us"] > 0 and rows["yields"]["nap_us"] == 0
    for mode, r in rows.items():
        assert r["reads"] > 100, (mode, r)  # one read a millisecond for 0.5 s
        assert r["view_keys"] > 0, (mode, r)  # the writer was changing the view meanwhile
        assert r["given_up"] == sum(r["given_up_why"].values()) and r["given_up"] < r["reads"], (mode, r)
        assert 0 < r["read_p50_us"] <= r["read_p99_us"] <= r["read_p999_us"], (mode, r)
    for t in out["targets"]:
        check_verdict(t)
