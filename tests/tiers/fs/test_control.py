"""The fs tier's control thread lives only as long as its Ray session."""

from __future__ import annotations

import threading

import pytest
import ray

import raykv
from raykv.core.factory import TierFactory
from raykv.engine.primary import PrimaryRegion
from tests.clusters import start_local_ray
from tests.waiting import wait_until

pytestmark = pytest.mark.long  # two Ray sessions


def _control_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "raykv-fs-control"]


def test_the_control_thread_ends_with_its_ray_session(tmp_path):
    """Ray shut down under a live fs tier (never shut down itself), then a new
    session in the same process: the tier's control thread, which polls its root
    actor every 0.1 s, stops instead of calling into a session that is not its own
    (a thread inside a Ray call at interpreter exit can crash it: ray-project/ray#47864)."""
    start_local_ray(num_cpus=1)
    before = set(_control_threads())
    services = raykv.start({"namespace": "raykv-fs-orphan", "directory_shards": 1})
    region = PrimaryRegion(4, 64 * 1024)
    TierFactory.create_tier(
        {"type": "fs", "root": str(tmp_path / "kv"), "fsync": False}, region.view, services=services
    )
    (thread,) = set(_control_threads()) - before
    ray.shutdown()
    start_local_ray(num_cpus=1)
    try:
        wait_until(lambda: not thread.is_alive(), timeout_s=30, what="the orphaned fs control thread to stop")
    finally:
        ray.shutdown()
        region.close()
