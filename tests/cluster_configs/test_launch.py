"""`ray up` of cluster_configs/onprem.yaml, for real, against this machine over SSH (opt-in: --launch).

The on-prem YAML's flow, with only what a one-machine run must change
(``_launch_yaml``): ``localhost`` as the head and no workers, the SSH user and
key of ``launch_host``, free ports instead of 6379/8080/8265 (other Rays may
run here), a 1 GiB object store and 4 CPUs, and, with no NFS server, a local directory in
place of the NFS mount (the fs tier's root in raykv.yaml and the Serve config
points there). Then: `raykv status` on the head shows the control actor,
shards and tiers; `serve deploy` of cluster_configs/serve_llm.yaml (the tiny
model on CPU) answers a prompt whose repeat reports cached tokens; `ray down`
leaves no process of the cluster's user and no raykv shared memory behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from raykv.demo.tiny_model import build_tiny_model, make_prompt_tokens
from tests.waiting import WaitTimeout, wait_until

sys.path.insert(0, os.path.dirname(__file__))
from launch_host import RAY_TMPDIR, USER, LaunchHost, missing_prerequisites  # noqa: E402

pytestmark = pytest.mark.launch

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
CLUSTER = "raykv-launch-test"
OBJECT_STORE = 1 << 30


def _sh(cmd: list[str], cwd: Path, timeout: float, log: list[str]) -> str:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - t0
    log.append(f"$ {' '.join(cmd)}  # {took:.0f} s, exit {proc.returncode}\n{proc.stdout[-6000:]}")
    assert proc.returncode == 0, f"{cmd} failed ({took:.0f} s):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _launch_yaml(stage: Path, key: Path, ports: dict[str, int], fs_root: str) -> Path:
    """onprem.yaml with the one-machine changes (see the module docstring); the rest as shipped."""
    cfg = yaml.safe_load((REPO / "cluster_configs" / "onprem.yaml").read_text())
    cfg["cluster_name"] = CLUSTER
    cfg["provider"].update(head_ip="localhost", worker_ips=[])
    cfg["max_workers"] = 0
    cfg["auth"] = {"ssh_user": USER, "ssh_private_key": str(key)}
    cfg["file_mounts"] = {"~/raykv-config": str(stage / "cluster_configs"), "~/raykv-dist": str(stage / "dist")}
    nfs = [c for c in cfg["setup_commands"] if "nfs" in c]
    assert len(nfs) == 2, cfg["setup_commands"]  # the nfs-common install and the mount
    cfg["setup_commands"] = [f"mkdir -p {fs_root}"] + [c for c in cfg["setup_commands"] if c not in nfs]

    def ports_of(cmd: str) -> str:
        return (
            cmd.replace("--port=6379", f"--port={ports['gcs']}")
            .replace("$RAY_HEAD_IP:6379", f"$RAY_HEAD_IP:{ports['gcs']}")
            .replace(
                "--metrics-export-port=8080",
                f"--metrics-export-port={ports['metrics']} --dashboard-port={ports['dashboard']} "
                f"--dashboard-agent-listen-port={ports['agent']} --dashboard-agent-grpc-port={ports['agent_grpc']}",
            )
            # 4 CPUs on this 2-core machine, so a vLLM replica (2 CPUs) and Serve's own actors fit.
            .replace("--object-store-memory=34359738368", f"--object-store-memory={OBJECT_STORE} --num-cpus=4")
        )

    cfg["head_start_ray_commands"] = [ports_of(c) for c in cfg["head_start_ray_commands"]]
    assert any(f"--port={ports['gcs']}" in c for c in cfg["head_start_ray_commands"])
    path = stage / "launch.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _stage(stage: Path, fs_root: str, model: str, serve_port: int) -> None:
    """The wheel and a copy of cluster_configs/ whose fs roots and Serve model fit one machine."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(stage / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    configs = stage / "cluster_configs"
    shutil.copytree(REPO / "cluster_configs", configs)
    raykv_cfg = yaml.safe_load((configs / "raykv.yaml").read_text())
    for tier in raykv_cfg["tiers"]:
        if tier["type"] == "fs":
            tier["root"] = fs_root
    (configs / "raykv.yaml").write_text(yaml.safe_dump(raykv_cfg, sort_keys=False))
    serve_cfg = yaml.safe_load((configs / "serve_llm.yaml").read_text())
    serve_cfg["http_options"] = {"host": "127.0.0.1", "port": serve_port}
    args = serve_cfg["applications"][0]["args"]
    args.update(model=model, model_id="tiny", num_replicas=1, accelerator="cpu", cpu_bytes=16 * (128 << 10))
    args["engine_kwargs"].update(max_model_len=2048, num_gpu_blocks_override=20, enforce_eager=True)
    for tier in args["raykv"]["tiers"]:
        if tier["type"] == "fs":
            tier["root"] = fs_root
        else:
            tier["capacity_bytes"] = 256 << 20
    (configs / "serve_llm.yaml").write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    subprocess.run(["chmod", "-R", "a+rX", str(stage)], check=True)


def _complete(port: int, tokens: list[int]) -> int:
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        usage = json.load(r)["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_ray_up_onprem_yaml_on_localhost(tmp_path, free_port) -> None:
    problem = missing_prerequisites()
    if problem:
        pytest.skip(problem)
    tmp_path.chmod(0o755)
    host = LaunchHost(tmp_path)
    fs_root = str(host.home / "raykv-kv")  # where no NFS server exists: a local directory
    shutil.rmtree(fs_root, ignore_errors=True)  # blocks of an earlier run would answer the first prompt
    ports = {k: free_port() for k in ("gcs", "metrics", "dashboard", "agent", "agent_grpc", "serve")}
    # Ray finds "its" cluster by scanning running GCS processes: with other Rays on this
    # machine, name ours (a machine of the cluster runs only one).
    from ray.util import get_node_ip_address

    host.export(RAY_ADDRESS=f"{get_node_ip_address()}:{ports['gcs']}")
    stage = tmp_path / "stage"
    model = build_tiny_model(host.home / "model")  # where the cluster's user can read it
    subprocess.run(["chown", "-R", f"{USER}:{USER}", model], check=True)
    _stage(stage, fs_root, str(model), ports["serve"])
    config = _launch_yaml(stage, host.key, ports, fs_root)
    log: list[str] = []
    timings: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        _sh([RAY, "up", "-y", "--no-config-cache", str(config)], stage, 900, log)
        timings["ray up"] = time.monotonic() - t0

        status = _sh([RAY, "exec", str(config), "raykv status --no-metrics"], stage, 300, log)
        for name in ("raykv-control", "raykv-directory-0", "raykv-directory-3", "object_store", "fs"):
            assert name in status, status

        t0 = time.monotonic()
        _sh(
            [
                RAY,
                "exec",
                str(config),
                f"serve deploy ~/raykv-config/serve_llm.yaml -a http://127.0.0.1:{ports['dashboard']}",
            ],
            stage,
            300,
            log,
        )

        def serve_answers() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['serve']}/v1/models", timeout=5) as r:
                return r.status == 200

        try:
            wait_until(serve_answers, timeout_s=600, interval_s=5, ignore=(OSError,), what="the Serve app to come up")
        except WaitTimeout as e:
            raise AssertionError(f"{e}\n" + "\n".join(log)) from None
        timings["serve deploy until ready"] = time.monotonic() - t0
        prompt = make_prompt_tokens(600, 0)
        first = _complete(ports["serve"], prompt)
        repeat = _complete(ports["serve"], prompt)
        log.append(f"cached tokens: first {first}, repeat {repeat}")
        assert repeat >= 512 and repeat > first, (first, repeat)
        status = _sh([RAY, "exec", str(config), "raykv status --no-metrics"], stage, 300, log)
    finally:
        t0 = time.monotonic()
        _sh([RAY, "down", "-y", str(config)], stage, 300, log)  # also after a partial `ray up`
        timings["ray down"] = time.monotonic() - t0
        host.close()
        print("\n".join(log))
        print("timings:", {k: round(v) for k, v in timings.items()})
    with contextlib.suppress(WaitTimeout):  # the assertion below lists what is left
        wait_until(lambda: not host.processes(), timeout_s=60, interval_s=2, what="the cluster user's processes to end")
    assert not host.processes(), host.processes()
    shm = host.shm_files()
    # raykv's own shared memory (primary regions: raykv_primary_*) is gone. vLLM's offload
    # region (vllm_offload_<engine>.mmap) and Python multiprocessing segments of the engine
    # processes that `ray stop` killed stay (see README, "Launch a cluster"); removed here.
    print("left in /dev/shm by the cluster's processes:", [p.name for p in shm])
    assert not [p for p in shm if p.name.startswith("raykv")], shm
    for p in shm:
        p.unlink()
    # The fs tier's block files are the cache's shared storage: they outlive the cluster by design
    # (a new root actor rescans them). This test's are removed.
    print("fs tier files after ray down:", sum(len(f) for _, _, f in os.walk(fs_root)))
    shutil.rmtree(fs_root, ignore_errors=True)
    assert Path(RAY_TMPDIR).exists()  # Ray's own session logs stay, as after any `ray stop`
