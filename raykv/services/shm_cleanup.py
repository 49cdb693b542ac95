"""Remove vLLM's CPU-offload shared-memory segments that no process uses any more.

vLLM's ``SharedOffloadRegion`` (the CPU primary tier's pages) lives in
``/dev/shm/vllm_offload_<engine id>.mmap``. vLLM unlinks it once every worker
mapped it, but an engine killed before that (or a ``ray down`` mid-start)
leaves the file behind, holding its whole size of RAM. raykv's node agents
keep their directory views in ``/dev/shm/raykv_view_*`` (``raykv.directory.shm_view``);
a crashed agent leaves them. ``raykv stop`` removes such leftovers on every node
(``clean_cluster``).

A segment is removed only when its owning processes are gone: no process has
it open or mapped (``/proc/<pid>/fd`` and ``/proc/<pid>/maps``). Only files of
this user are considered: those are the ones it may delete, and its own
processes are the ones whose ``/proc`` entries it can read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from raykv.directory import shm_view

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: vLLM's name for the segment (``vllm/v1/kv_offload/cpu/shared_offload_region.py``).
PREFIX, SUFFIX = "vllm_offload_", ".mmap"
#: raykv's node views (their header files, and each header's table generations).
VIEW_PREFIX = shm_view.PREFIX


def _ours(name: str) -> bool:
    return (name.startswith(PREFIX) and name.endswith(SUFFIX)) or name.startswith(VIEW_PREFIX)


def _segments(shm_dir: str) -> list[str]:
    uid = os.getuid()
    out: list[str] = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return out
    for e in entries:
        if not _ours(e.name):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if (uid == 0 or st.st_uid == uid) and not e.is_symlink() and e.is_file(follow_symlinks=False):
            out.append(os.path.realpath(e.path))
    return out


def _in_use(paths: Iterable[str]) -> set[str]:
    """Which of ``paths`` some process has open or mapped (as far as /proc shows)."""
    wanted = set(paths)
    used: set[str] = set()
    if not wanted:
        return used
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target in wanted:
                    used.add(target)
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].rstrip("\n") in wanted:
                        used.add(parts[5].rstrip("\n"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """This user's vLLM offload segments in ``shm_dir`` that no process has open or mapped."""
    segments = _segments(shm_dir)
    used = _in_use(segments)
    return sorted(p for p in segments if p not in used)


def _kind(path: str) -> str:
    """What a segment is, for the log line."""
    return "raykv directory view" if os.path.basename(path).startswith(VIEW_PREFIX) else "vLLM offload segment"


def remove_stale_segments(shm_dir: str = SHM_DIR) -> dict[str, int]:
    """Delete ``stale_segments``; returns path -> bytes freed."""
    removed: dict[str, int] = {}
    for path in stale_segments(shm_dir):
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            logger.warning("cannot remove leftover %s %s: %r", _kind(path), path, e)
            continue
        removed[path] = size
        logger.info("removed leftover %s %s (%d bytes, no process uses it)", _kind(path), path, size)
    return removed


def clean_cluster(timeout: float = 60.0) -> dict[str, dict[str, int]]:
    """``remove_stale_segments`` on every alive node of the connected Ray
    cluster (one zero-CPU task per node); node id -> path -> bytes freed.
    Nodes that do not answer in ``timeout`` are left out."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(remove_stale_segments)
    refs = {
        node["NodeID"]: task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote()
        for node in ray.nodes()
        if node.get("Alive")
    }
    out: dict[str, dict[str, int]] = {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    for node_id, ref in refs.items():
        if ref in done:
            try:
                out[node_id] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a node's clean-up must not stop the others'
                logger.warning("shared-memory clean-up on node %s failed: %r", node_id[:12], e)
    return out


def summary(cleaned: dict[str, dict[str, int]]) -> str:
    """One line for ``raykv stop``."""
    from raykv.core.units import fmt_bytes

    paths = [p for per in cleaned.values() for p in per]
    if not paths:
        return "no leftover vLLM shared-memory segments"
    freed = sum(n for per in cleaned.values() for n in per.values())
    nodes = sum(1 for per in cleaned.values() if per)
    return f"removed {len(paths)} leftover vLLM shared-memory segments ({fmt_bytes(freed)}) on {nodes} node(s)"
