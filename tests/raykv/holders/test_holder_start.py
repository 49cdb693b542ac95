"""A holder actor whose start fails: nothing of it outlives the failure, and a later
start gets a fresh actor instead of the broken one (on a real local Ray)."""

from __future__ import annotations

import time

import pytest
import ray

import raykv
from raykv.core import naming
from raykv.core.errors import RaykvError
from raykv.core.named import find_actor
from raykv.core.wire import PLASMA, HolderInfo
from raykv.engine.actor_tier import start_holder_actor
from raykv.holders.holder_actor import HolderActor
from tests.waiting import wait_until

NS = "raykv-holder-start"
NAME = "raykv-test-holder"


class _TestHolder(HolderActor):
    """A holder that holds nothing; it fails where told to."""

    def __init__(self, fail_in: str) -> None:
        super().__init__(HolderInfo("test:holder", "test", PLASMA, NAME, NS), NS, {})
        self.requested_capacity = 0
        if fail_in == "init":
            raise OSError("the storage is not mounted")
        self.fail_in = fail_in

    def held_keys(self) -> list[bytes]:
        return []

    def occupancy(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def status_line(self) -> str:
        return "test holder"

    async def recover(self) -> None:
        if self.fail_in == "start":
            raise OSError("the storage went away")


TestHolder = ray.remote(num_cpus=0, max_restarts=-1)(_TestHolder)


@pytest.fixture(scope="module")
def services(ray_local):
    s = raykv.start({"namespace": NS, "directory_shards": 2})
    yield s
    s.shutdown()


def _start(fail_in: str):
    return TestHolder.options(name=NAME, namespace=NS, lifetime="detached", get_if_exists=True).remote(fail_in)


def _agents() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NS and a["name"].startswith(naming.DIRECTORY_AGENT_PREFIX)
    ]


def test_a_holder_whose_init_raised_announces_nothing_and_starts_no_agent(services) -> None:
    assert _agents() == []  # raykv alone starts no agent: a holder's start-up does
    with pytest.raises(RaykvError, match="the test holder did not start: .*the storage is not mounted"):
        start_holder_actor(_start("init"), "the test holder", 0, 30)
    # Its start-up task would announce it and start the node's agent within a moment.
    time.sleep(2.0)
    assert "test:holder" not in {h.holder_id for h in services.holders()}
    assert _agents() == []


def test_a_holder_whose_start_up_failed_is_stopped_so_the_next_start_is_fresh(services) -> None:
    first = _start("start")
    with pytest.raises(RaykvError, match="the test holder did not start: .*the storage went away"):
        start_holder_actor(first, "the test holder", 0, 30)
    wait_until(lambda: find_actor(NAME, NS) is None, timeout_s=30, what="the broken holder to be gone")
    ready = start_holder_actor(_start("nowhere"), "the test holder", 0, 30)
    assert ready.holder.holder_id == "test:holder"
    ray.kill(find_actor(NAME, NS))
