"""vLLM's leftover /dev/shm/vllm_offload_* segments: removed by `raykv stop` once no process uses them."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

import raykv
from raykv.ops.cli import main
from raykv.services.shm_cleanup import remove_stale_segments, stale_segments

#: Maps the file, says so, then waits until its stdin closes (a live engine's worker).
HOLD = (
    "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close(); "
    "print('mapped', flush=True); sys.stdin.read()"
)


def _segment(shm_dir: Path, size: int = 1 << 16) -> Path:
    path = shm_dir / f"vllm_offload_raykv-test-{uuid.uuid4().hex}.mmap"
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def holder() -> Iterator:
    """Start a process that maps a segment and keeps it mapped until the test ends."""
    procs: list[subprocess.Popen] = []

    def hold(path: Path) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert p.stdout.readline().strip() == "mapped"
        procs.append(p)
        return p

    yield hold
    for p in procs:
        p.stdin.close()
        p.wait(10)


def test_only_segments_no_process_uses_are_removed(tmp_path, holder) -> None:
    live, orphan, held_open = _segment(tmp_path), _segment(tmp_path), _segment(tmp_path)
    other = tmp_path / "psm_not_vllm"
    other.write_bytes(b"x")
    holder(live)  # mapped (the fd closed: a worker after vLLM's barrier)
    with open(held_open, "rb"):  # open, not mapped yet (a worker still starting)
        assert stale_segments(str(tmp_path)) == [str(orphan)]
        assert remove_stale_segments(str(tmp_path)) == {str(orphan): 1 << 16}
    assert not orphan.exists() and live.exists() and held_open.exists() and other.exists()


def test_raykv_stop_removes_leftover_segments(ray_local, holder, capsys) -> None:
    """`raykv stop` on a running raykv: the segment of an engine that is gone goes, the one a
    live process maps stays."""
    shm = Path("/dev/shm")
    if not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    namespace = "raykv-shm-cleanup-test"
    raykv.start({"namespace": namespace, "directory_shards": 1})
    orphan, live = _segment(shm), _segment(shm)
    try:
        holder(live)
        code = main(["stop", "--namespace", namespace, "--address", ray.get_runtime_context().gcs_address])
        out = capsys.readouterr().out
        assert code == 0 and "raykv stopped" in out
        assert "removed" in out and "leftover vLLM shared-memory segments" in out, out
        assert not orphan.exists() and live.exists()
    finally:
        for p in (orphan, live):
            p.unlink(missing_ok=True)


def test_a_crashed_agents_view_files_are_leftovers_too(tmp_path, holder) -> None:
    """A node agent's view (header and table generation) outlives an agent that
    crashed: removed once nobody maps it; a live engine's mapping keeps it."""
    made = subprocess.run(  # an agent that wrote its view and died
        [
            sys.executable,
            "-c",
            "import sys; from raykv.directory.shm_view import ViewWriter, view_path; "
            "w = ViewWriter(view_path('raykv-test', 'node-x', sys.argv[1])); w.allocate(128); "
            "print(w.path, w.generation)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    path, generation = made.stdout.split()
    header, table = Path(path), Path(f"{path}.{generation}")
    assert header.exists() and table.exists()
    reader = holder(table)  # an engine still maps the table
    assert stale_segments(str(tmp_path)) == [str(header)]
    reader.stdin.close()
    reader.wait(10)
    assert sorted(stale_segments(str(tmp_path))) == sorted([str(header), str(table)])
    remove_stale_segments(str(tmp_path))
    assert not header.exists() and not table.exists()
