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
