"""``LookupCache`` against a real directory: our own stores stay known even when they land
while the key's lookup is in flight."""

from __future__ import annotations

import pytest

import raykv
from raykv.core.placement import SHARED, HolderInfo
from raykv.directory.client import LookupCache

KEY = b"k" * 40 + b"\x00\x00\x00\x00"


@pytest.fixture
def services(ray_local):
    s = raykv.start({"namespace": "raykv-lookup-cache", "directory_shards": 2})
    yield s
    s.shutdown()


def _holder() -> HolderInfo:
    return HolderInfo("fs:/shared", "fs", SHARED, "raykv-fs", "raykv-lookup-cache")


def test_a_store_noted_while_the_lookup_is_in_flight_survives_its_answer(services) -> None:
    cache = LookupCache(services.directory, ttl_s=60.0)
    cache.request(KEY)
    cache.flush()  # in flight: the directory answers "nobody" (it was asked before the store)
    cache.note_stored([KEY], _holder())
    cache.wait(timeout=30)
    assert cache.get(KEY) == [_holder()]


def test_a_store_noted_after_the_answer_is_added_to_it(services) -> None:
    cache = LookupCache(services.directory, ttl_s=60.0)
    cache.request(KEY)
    cache.wait(timeout=30)
    assert cache.get(KEY) == []
    cache.note_stored([KEY], _holder())
    assert cache.get(KEY) == [_holder()]


def test_a_store_of_a_key_never_looked_up_is_not_cached(services) -> None:
    """Other tiers may hold it too: an answer naming only our holder would be wrong."""
    cache = LookupCache(services.directory, ttl_s=60.0)
    cache.note_stored([KEY], _holder())
    assert cache.get(KEY) is None


def test_an_answer_that_came_back_ends_pending_work_without_a_lookup(services) -> None:
    """An idle engine asks its tiers ``has_pending_work`` each loop: once the directory
    answered, the cache says no, with no lookup (``poll``) needed to take the answer in."""
    import time

    cache = LookupCache(services.directory, ttl_s=60.0)
    assert not cache.has_pending()
    cache.request(KEY)
    assert cache.has_pending()  # queued, not sent yet
    cache.flush()
    round_before = cache.round
    deadline = time.monotonic() + 30
    while cache.has_pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not cache.has_pending()
    assert cache.get(KEY) == []  # the answer is in: nobody holds it
    cache.flush()
    assert cache.round == round_before  # taking answers in is not a lookup round
