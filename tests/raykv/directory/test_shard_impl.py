"""``DirectoryShardImpl`` without Ray: holder semantics over fingerprints."""

from __future__ import annotations

import numpy as np

from raykv.core.keys import pending_key, prefix_keys
from raykv.core.placement import PLASMA, SHARED, HolderInfo, decode_reply
from raykv.core.wire import PENDING
from raykv.directory.fingerprint import fingerprints, to_blob
from raykv.directory.shard import DirectoryShardImpl


def _info(name: str, medium: str = PLASMA) -> HolderInfo:
    return HolderInfo(name, "object_store" if medium == PLASMA else "fs", medium, name, "ns", "n1")


def _holders(shard: DirectoryShardImpl, keys: list[bytes]) -> list[set[str]]:
    return [{h.holder_id for h in hs} for hs in decode_reply(shard.lookup(to_blob(fingerprints(keys))))]


def test_register_unregister_drop_keep_counts_exact():
    s = DirectoryShardImpl(0, 1)
    a, b = _info("a"), _info("b", SHARED)
    s.add_holder(a)
    s.add_holder(b)
    keys = prefix_keys(list(range(4000)), 16)  # 250 keys
    assert s.register("a", to_blob(fingerprints(keys[:200]))) == 200
    assert s.register("a", to_blob(fingerprints(keys[:10] + keys[:10]))) == 0  # already held, duplicates
    assert s.register("b", keys[100:250]) == 150  # keys (a holder's resync) work too
    assert s.num_keys == 250
    got = _holders(s, keys)
    assert got[:100] == [{"a"}] * 100 and got[100:200] == [{"a", "b"}] * 100 and got[200:] == [{"b"}] * 50
    assert s.unregister("a", to_blob(fingerprints(keys[150:250]))) == 50
    assert s.stats().holders == {"a": 150, "b": 150}
    assert s.drop_holder("b", "died") == 150
    assert _holders(s, keys) == [{"a"}] * 150 + [set()] * 100
    assert s.num_keys == 150 and s.invalidated == {"evicted": 50, "died": 150}
    assert set(s.holder_fingerprints("a").tolist()) == set(fingerprints(keys[:150]).tolist())
    assert s.register("b", keys) == 0  # a dropped holder's late registration is ignored


def test_identity_scoped_keys_never_share_an_entry():
    s = DirectoryShardImpl(0, 1)
    s.add_holder(_info("a"))
    body = prefix_keys(list(range(640)), 64)
    tag_x, tag_y = b"X" * 8, b"Y" * 8
    s.register("a", [tag_x + k for k in body])
    assert _holders(s, [tag_y + k for k in body]) == [set()] * len(body)
    assert _holders(s, [tag_x + k for k in body]) == [{"a"}] * len(body)


def test_a_dropped_holders_slot_is_reused_without_stale_entries():
    s = DirectoryShardImpl(0, 1)
    s.add_holder(_info("a"))
    keys = prefix_keys(list(range(800)), 8)
    s.register("a", keys)
    s.drop_holder("a", "died")
    slot = s.add_holder(_info("c"))
    assert slot == 0  # a's slot, free again
    assert _holders(s, keys) == [set()] * len(keys)


def test_many_keys_through_rebuilds():
    s = DirectoryShardImpl(0, 1)
    s.add_holder(_info("a"))
    rng = np.random.default_rng(3)
    keys = [bytes(k) for k in rng.integers(0, 256, (50_000, 44), dtype=np.uint8)]
    for i in range(0, len(keys), 5000):
        s.register("a", to_blob(fingerprints(keys[i : i + 5000])))
        s.unregister("a", to_blob(fingerprints(keys[i : i + 1000])))
    held = [bool(h) for h in _holders(s, keys)]
    want = [(i % 5000) >= 1000 for i in range(len(keys))]
    assert held == want and s.num_keys == sum(want)


def test_pending_entries_are_listed_apart_from_held_keys():
    """Blocks being computed (``raykv.holders.pending``) are listed under their own
    keys, and the shard's key count, its metrics and ``raykv status`` leave them out."""
    s = DirectoryShardImpl(0, 1)
    s.add_holder(_info("a"))
    s.add_holder(HolderInfo("pending:n1:7", "pending", PENDING, "p7", "ns", "n1"))
    keys = prefix_keys(list(range(160)), 16)  # 10 keys
    s.register("a", keys[:4])
    assert s.register("pending:n1:7", [pending_key(k) for k in keys[4:]]) == 6
    stats = s.stats()
    assert (stats.keys, stats.pending_keys, s.figures()["num_keys"]) == (4, 6, 4)
    assert _holders(s, keys[4:]) == [set()] * 6  # a pending entry is never a holder of the block
    assert _holders(s, [pending_key(k) for k in keys[4:]]) == [{"pending:n1:7"}] * 6
    s.unregister("pending:n1:7", [pending_key(k) for k in keys[4:]])
    assert (s.stats().keys, s.stats().pending_keys) == (4, 0)


def test_the_first_claim_of_a_pending_key_wins():
    """Compute once: engines that announce the same block at once each claim it; the
    shard serialises them, so exactly the first is told nobody listed it before."""
    s = DirectoryShardImpl(0, 1)
    for name in ("p1", "p2", "p3"):
        s.add_holder(_info(name, PENDING))
    pk = pending_key(prefix_keys(list(range(16)), 16)[0])
    assert s.claim("p2", [pk]) == 0  # first
    assert s.claim("p1", [pk]) == 1  # p2 came first
    assert s.claim("p2", [pk]) == 1  # asking again: p1 is there now; still registered once
    assert s.claim("p3", [pk]) == 2
    assert _holders(s, [pk]) == [{"p1", "p2", "p3"}]
    assert s.claim("unknown", [pk]) == -1  # a holder the shard does not know registers nothing
    s.unregister("p2", [pk])
    s.unregister("p1", [pk])
    assert s.claim("p1", [pk]) == 1  # p3 still computes it
