"""``raykv bench flood``: its options, accounting and table (no cluster), and its quick
run (marked ``e2e``: ``make test-e2e``; the full run is in docs/PERFORMANCE.md)."""

from __future__ import annotations

import pytest

from raykv.bench import flood
from raykv.ops.cli import build_parser
from tests.benches import run_bench


def _probe(kind: str, cached: int, ttft_ms: float, replica: str = "a", local: int = 0, remote: int = 0) -> flood.Probe:
    return {
        "replica": replica,
        "kind": kind,
        "engine_blocks_before": 0,
        "tier_blocks_before": 30,
        "cached_tokens": cached,
        "raykv_share": cached / 3840,
        "ttft_ms": ttft_ms,
        "local_blocks": local,
        "remote_blocks": remote,
    }


def _tier(cycles: float) -> flood.TierFigures:
    return {
        "tier": "fs",
        "capacity_bytes": 100,
        "flood_stored_bytes": int(100 * cycles),
        "cycles": cycles,
        "evicted_blocks": 10,
        "pinned_blocks": 30,
        "pins_refused": 0,
    }


def test_its_options_are_checked_before_a_cluster_starts() -> None:
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="--replicas"):
        flood.run(parse(["bench", "flood", "--replicas", "1"]))
    with pytest.raises(ValueError, match="max_model_len"):
        flood.run(parse(["bench", "flood", "--prefix-tokens", "4000"]))
    with pytest.raises(ValueError, match="--suffix-tokens"):
        flood.run(parse(["bench", "flood", "--suffix-tokens", "32"]))
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        flood.run(parse(["bench", "flood", "--tier-prefixes", "1.5"]))
    with pytest.raises(ValueError, match="--configs"):
        flood.run(parse(["bench", "flood", "--configs", "pinned,nonsense"]))
    # the 20480-token prefix does not fit the local models: the most full blocks that do
    args = parse(["bench", "flood"])
    configs, note = flood.check_options(args)
    assert configs == ["pinned", "unpinned", "all_nodes"] and args.prefix_tokens == 3840 == flood.prefix_limit(
        128, 4096
    )
    assert args.flood_tokens == 3840 and "20480" in note and args.max_model_len == 4096
    assert flood.engine_blocks(args) == flood.ENGINE_BLOCKS  # 64: twice the 30-block prefix, plus room
    # the bench model with 32768 positions takes the prefix, and engines twice its size
    args = parse(["bench", "flood", "--model", "bench-long"])
    configs, note = flood.check_options(args)
    assert args.prefix_tokens == 20480 == args.flood_tokens and note == "" and args.max_model_len == 32768
    assert flood.engine_blocks(args) == 2 * 160 + 4
    with pytest.raises(ValueError, match="--model: no such model directory '/nonexistent'"):
        flood.check_options(parse(["bench", "flood", "--model", "/nonexistent"]))


def test_the_summary_and_target_read_each_replicas_first_probe() -> None:
    probes = [
        _probe("first", 3840, 400, "a"),
        _probe("engine", 3840, 100, "a"),
        _probe("first", 3712, 600, "b"),
        _probe("engine", 3840, 120, "b"),
    ]
    pinned = flood._summary(12, 30.0, [_tier(3.2)], probes, replicas=2, prefix_blocks=30)
    assert (
        pinned["next_share"] == 1.0
        and pinned["next_ttft_ms"] == 400
        and pinned["first_share_min"] == pytest.approx(3712 / 3840)
    )
    assert pinned["replicas_probed"] == 2
    assert pinned["first_ttft_ms"] == 500 and pinned["floor_ttft_ms"] == 110
    assert pinned["ttft_vs_floor"] == pytest.approx(500 / 110)
    assert not pinned["first_all_local"]  # no probe loaded from an object store
    unpinned = flood._summary(12, 30.0, [_tier(3.2)], [_probe("first", 0, 2000)], replicas=2, prefix_blocks=30)
    assert unpinned["floor_ttft_ms"] is None and unpinned["ttft_vs_floor"] is None
    (t,) = flood._targets({"pinned": pinned, "unpinned": unpinned}, replicas=2)
    assert t["passed"] is False and "unpinned: 0.0%" in t["detail"]  # 96.7% < 99%
    assert flood._targets({"pinned": {"error": "x"}}, replicas=2) == []
    text = flood.format_result(
        {
            "benchmark": "flood",
            "machine": {},
            "replicas": 2,
            "prefix_tokens": 3840,
            "cacheable_prefix_tokens": 3840,
            "prefix_note": "",
            "suffix_tokens": 128,
            "flood_tokens": 3840,
            "block_bytes": 131072,
            "object_store_capacity_bytes": 100,
            "fs_capacity_bytes": 100,
            "cycles_target": 3.0,
            "ttl_s": 3600.0,
            "model": "bench",
            "configs": {"pinned": pinned, "unpinned": {"error": "RuntimeError: boom"}},
            "targets": [t],
        }
    )
    assert "failed: RuntimeError: boom" in text and "own node" in text and "96.7%" in text and "3.2" in text


def test_all_nodes_wants_every_replicas_first_load_from_its_own_node() -> None:
    local = [
        _probe("first", 3840, 300, "a", local=30),
        _probe("engine", 3840, 250, "a"),
        _probe("first", 3840, 330, "b", local=30),
    ]
    summary = flood._summary(8, 20.0, [_tier(3.0)], local, replicas=2, prefix_blocks=30)
    assert summary["first_all_local"] and summary["ttft_vs_floor"] == pytest.approx(315 / 250)
    (t,) = flood._targets({"all_nodes": summary}, replicas=2)
    assert t["passed"] is True and "30/0, 30/0" in t["detail"]
    # one replica pulled blocks off another node: a miss, however fast
    pulled = [*local[:2], _probe("first", 3840, 260, "b", local=20, remote=10)]
    summary = flood._summary(8, 20.0, [_tier(3.0)], pulled, replicas=2, prefix_blocks=30)
    assert not summary["first_all_local"]
    (t,) = flood._targets({"all_nodes": summary}, replicas=2)
    assert t["passed"] is False and "from its own node: False" in t["detail"]
    # a replica never probed: a miss too
    (t,) = flood._targets({"all_nodes": flood._summary(8, 20.0, [], local[:2], 2, 30)}, replicas=2)
    assert t["passed"] is False and "1/2 replicas" in t["detail"]


def test_object_store_counters_split_local_loads_from_pulls() -> None:
    before = {"object_store@a": {"counters": {"hits": 5, "hits_remote": 1}}, "fs": {"committed": 3}}
    after = {
        "object_store@a": {"counters": {"hits": 35, "hits_remote": 1}},
        "object_store@b": {"counters": {"hits": 4, "hits_remote": 4}},
        "fs": {"committed": 9},
    }
    assert flood._object_store_loads(before, after) == (30, 4)


def test_tier_counters_give_the_flood_s_stored_bytes() -> None:
    before = {"fs": {"files": 2, "bytes": 200, "capacity_bytes": 1000, "committed": 2, "evicted": 0}}
    after = {
        "fs": {"files": 10, "bytes": 1000, "capacity_bytes": 1000, "committed": 32, "evicted": 22, "pinned_blocks": 2},
        "object_store@n1": {
            "capacity_bytes": 500,
            "pinned_blocks": 3,
            "counters": {"stored_bytes": 1600, "evicted_blocks": 12, "pins_refused_tier_cap": 1},
        },
    }
    fs_row, os_row = flood._tier_rows(before, after)
    assert fs_row["flood_stored_bytes"] == 32 * 100 - 2 * 100 and fs_row["cycles"] == 3.0
    assert fs_row["evicted_blocks"] == 22 and fs_row["pinned_blocks"] == 2
    assert os_row["cycles"] == 3.2 and os_row["evicted_blocks"] == 12 and os_row["pins_refused"] == 1


@pytest.mark.slow
@pytest.mark.e2e
def test_flood_quick_json(vllm_env) -> None:
    """The quick run of the two configurations with targets reports each tier cycled and
    both targets. ``unpinned`` (the pinned run without ``cache_ttl_s``: the baseline the
    first target quotes) is left out for CI's time: a Serve app per configuration makes
    each about 2 minutes here, and that a flood evicts an unpinned prompt is tested on
    real engines in tests/integrations/vllm/test_pins.py."""
    out = run_bench("flood", "--quick", "--configs", "pinned,all_nodes", timeout=1500)
    assert out["benchmark"] == "flood" and set(out["configs"]) == {"pinned", "all_nodes"}
    for name, r in out["configs"].items():
        assert "error" not in r, (name, r)
        assert len(r["tiers"]) == 3 and all(t["cycles"] >= out["cycles_target"] for t in r["tiers"]), r["tiers"]
        assert r["replicas_probed"] >= 1 and r["probes"], r
    assert out["targets"][0]["target"].startswith("pinned prefix after the flood")
    # warm --all-nodes put a copy on each node: every probed replica's first request loaded locally
    copies = out["configs"]["all_nodes"]
    assert copies["first_all_local"], copies["probes"]
    assert out["targets"][1]["target"].startswith("warm --all-nodes")
