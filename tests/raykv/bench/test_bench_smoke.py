"""Smoke tests of ``raykv bench``: the quick configurations run and report every key.

Nothing here asserts a timing: the numbers depend on the machine. Each whole
bench run is marked ``e2e`` (``make test-e2e``, in CI; ``make test`` leaves them out).
"""

from __future__ import annotations

import math

import pytest

from raykv import bench
from raykv.ops.cli import build_parser
from tests.benches import check_verdict, run_bench

DATAPLANE_KEYS = (
    "memcpy_gbps",
    "object_store_store_gbps",
    "object_store_load_gbps",
    "fs_store_gbps",
    "fs_load_gbps",
    "raw_file_write_gbps",
    "raw_file_read_gbps",
    "vllm_fs_store_gbps",
    "vllm_fs_load_gbps",
    "cross_node_load_gbps",
    "object_store_load_vs_memcpy",
    "fs_store_vs_raw",
    "fs_load_vs_vllm_fs",
)
DIRECTORY_KEYS = ("lookup_keys_per_s", "lookup_p50_ms", "lookup_p99_ms")


def test_registry_and_parser() -> None:
    names = bench.available()
    assert {"dataplane", "directory"} <= set(names)
    args = build_parser().parse_args(["bench", "directory", "--quick", "--shards", "1"])
    assert args.bench == "directory" and args.quick and args.shards == "1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "no-such-benchmark"])


@pytest.mark.e2e
def test_dataplane_quick_json(tmp_path) -> None:
    out = run_bench("dataplane", "--quick", "--block-sizes", "64KiB,2MiB", "--root", str(tmp_path))
    assert out["benchmark"] == "dataplane"
    assert set(out["block_sizes"]) == {"64KiB", "2MiB"}
    for label, d in out["block_sizes"].items():
        missing = [k for k in DATAPLANE_KEYS if k not in d]
        assert not missing, f"{label}: {missing}"
        for k in (
            "memcpy_gbps",
            "object_store_load_gbps",
            "fs_load_gbps",
            "raw_file_read_gbps",
            "cross_node_load_gbps",
        ):
            assert d[k] is not None and d[k] > 0, (label, k, d[k])
        assert not d["failures"], d["failures"]
        assert set(d["by_batch"]) == {"1", "8"}
    assert {t["target"].split(" (")[0] for t in out["targets"]} >= {
        "object_store load / memcpy",
        "fs store / raw file write",
        "fs load / vLLM fs load",
    }
    for t in out["targets"]:  # each verdict agrees with its own figures (no timing is asserted)
        check_verdict(t)


@pytest.mark.e2e
def test_directory_quick_json() -> None:
    out = run_bench("directory", "--quick", "--keys", "5k", "--call-sizes", "100,1k", "--calls", "5")
    assert out["benchmark"] == "directory"
    assert set(out["configs"]) == {"shards=1,keys=5000", "shards=2,keys=5000"}
    for name, c in out["configs"].items():
        assert c["directory_keys"] == 5000, name
        assert c["bytes_per_key"] is not None
        floor = c["floor"]  # the per-call floor: a no-op call and a 1-key lookup
        assert all(floor[k] > 0 for k in ("ping_p50_ms", "ping_p99_ms", "one_key_p50_ms", "one_key_p99_ms")), floor
        assert floor["ping_p99_ms"] >= floor["ping_p50_ms"]
        for size in ("100", "1000"):
            m = c["calls"][size]
            assert all(m[k] is not None and m[k] > 0 for k in DIRECTORY_KEYS), (name, size, m)
            assert m["misses"] == 0
    assert len(out["rows"]) == 4
    assert all(r["lookup_keys_per_s"] > 0 and "bytes_per_key" in r for r in out["rows"])
    # the node agents: the same trace without agents, with them (views of every key), and with views of asked keys
    agents = out["agents"]
    for key in ("without_agents", "with_agents", "with_agents_asked_keys"):
        c = agents[key]
        assert c["lookups"] > 0 and c["calls_per_shard_per_s"] > 0, (key, c)
        assert sum(c["calls_per_shard_per_s_by_method"].values()) == pytest.approx(c["calls_per_shard_per_s"], abs=0.5)
    assert set(agents["without_agents"]["calls_per_shard_per_s_by_method"]) <= {"lookup", "register", "unregister"}
    for key in ("with_agents", "with_agents_asked_keys"):
        c = agents[key]
        assert c["lag_p99_ms"] is not None and c["view_read_32_p50_us"] > 0, (key, c)
        assert "lookup" not in c["calls_per_shard_per_s_by_method"]  # every call goes through the agent
    complete = agents["with_agents"]
    assert complete["lookups_without_a_call"] >= 0.8 * complete["lookups"], complete  # a complete view asks nothing
    assert len(out["targets"]) >= 4
    for t in out["targets"]:
        check_verdict(t)


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_quick_json_has_the_floor_and_the_rounds(vllm_env) -> None:
    """``bench e2e`` measures the engine's own cache as the floor and reports raykv against it.
    With ``--rounds 2`` each config runs twice (the second round in reverse order, on roots of
    its own, so it starts cold too), and issue 24's paired lines are judged on the rounds'
    ratios. One run covers both (a bench run starts a cluster and models: about a minute here);
    ``no_offload`` is the one config it leaves out (the ``engine_hit`` floor stands for vLLM alone)."""
    configs = ("engine_hit", "raykv", "vllm_fs")
    out = run_bench("e2e", "--quick", "--tiny", "--configs", ",".join(configs), "--rounds", "2", timeout=900)
    cfg = out["configs"]
    assert set(configs) == set(cfg)
    # the floor: every request finds its whole cacheable prefix in the serving engine's own cache
    assert cfg["engine_hit"]["hit_tokens"] == out["oracle_hit_tokens"] > 0
    assert out["sessions_in_flight"] == 2  # no barrier: one session per replica in flight
    assert all(c["cascade_dropped_blocks"] >= 0 for c in cfg.values())
    for c in cfg.values():  # the engine loops' steps over the trace: a request's decode alone takes output_tokens
        steps = c["engine_loop_steps"]
        assert steps["request_steps"] >= out["output_tokens"] and steps["request_cpu_s"] > 0, steps
        assert steps["offload_steps"] >= 0 and steps["offload_cpu_s"] >= 0, steps
    # hits by source (vLLM's counters): the floor's all come from the engine's own cache
    assert sum(cfg["engine_hit"]["hits_by_source"].values()) >= cfg["engine_hit"]["hit_tokens"]
    floor = out["floor_ratio"]
    assert floor["ttft_p50_to_engine_hit"] == pytest.approx(
        cfg["raykv"]["ttft_p50_ms"] / cfg["engine_hit"]["ttft_p50_ms"]
    )
    probes = out["prefix_probes"]
    assert probes["engine_hit"]["cached_tokens_p50"] == probes["raykv"]["cached_tokens_p50"] == 1024
    assert floor["probe_to_engine_hit"] == pytest.approx(
        probes["raykv"]["raykv_ttft_p50_ms"] / probes["engine_hit"]["raykv_ttft_p50_ms"]
    )
    # raykv's time on the engines' scheduler threads over the trace (raykv.metrics.step_cost)
    cost = out["raykv_lookups"]["raykv"]
    assert cost["steps"] > 0 and 0 < cost["step_ms_mean"] < 50, cost
    assert cost["step_ms_p99"] >= cost["step_ms_mean"] * 0.5 and cost["polls_per_step"] > 0, cost
    names = [t["target"] for t in out["targets"]]
    assert "1k-prefix probe TTFT raykv / engine_hit floor" in names
    rounds, medians = out["rounds"], out["round_medians"]
    assert len(rounds) == 2 and all(set(r) == set(configs) for r in rounds)
    for name in configs:
        figures = [r[name] for r in rounds]
        # a cold start each round: a root kept from round 1 would hit first turns, past the oracle
        assert all(0 < f["hit_tokens"] <= out["oracle_hit_tokens"] for f in figures), figures
        assert figures[0]["hit_tokens"] == out["configs"][name]["hit_tokens"]  # the full report is round 1's
        assert all(f["host_cpu_s"] > 0 and f["ttft_p50_ms"] > 0 for f in figures), figures
        assert medians[name]["host_cpu_s"] == pytest.approx(sum(f["host_cpu_s"] for f in figures) / 2)
    cpu = next(t for t in out["targets"] if t["target"] == "host CPU s raykv / vLLM fs, median of 2 rounds")
    ratios = [r["raykv"]["host_cpu_s"] / r["vllm_fs"]["host_cpu_s"] for r in rounds]
    assert cpu["value"] == pytest.approx(sum(ratios) / 2)
    # and how far two rounds resolve it: the geometric mean of the ratios, with its 95% interval
    assert f"geometric mean {math.sqrt(ratios[0] * ratios[1]):.3f} (95% interval" in cpu["detail"], cpu
    for t in out["targets"]:
        check_verdict(t)
