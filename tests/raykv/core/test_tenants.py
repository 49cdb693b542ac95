"""Per-tenant quotas: the eviction order alone, then two tenants on real object_store and fs tiers."""

from __future__ import annotations

import numpy as np
import pytest
import ray

import raykv
from raykv.config.options import RaykvConfig
from raykv.core.contract import LookupResult, ReqContext
from raykv.core.factory import TierFactory
from raykv.core.tenants import (
    ISOLATED,
    SALT_PREFIX,
    TenantLRU,
    TenantSharing,
    engine_salt,
    tenant_key,
    tenant_label,
    tenant_of,
)
from raykv.core.validate import ConfigError
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from raykv.ops.status import collect_status, format_status

BLOCK = 64 * 1024
NS = "raykv-tenants-test"
#: The test namespace's opt-in: tenant-c and tenant-d share; every other tenant is isolated.
SHARED = {"team-cd": ["tenant-c", "tenant-d"]}


def test_tenant_of_request() -> None:
    assert tenant_of(ReqContext("r", tenant="a", cache_salt="s")) == "a"
    assert tenant_of(ReqContext("r", kv_transfer_params={"tenant": "b"})) == "b"
    assert tenant_of(ReqContext("r", cache_salt="salt-c")) == "salt-c"
    assert tenant_of(ReqContext("r")) == "" and tenant_of(None) == ""


def test_tenant_label_is_not_the_salt() -> None:
    assert tenant_label(ReqContext("r", kv_transfer_params={"tenant": "b"}, cache_salt="s")) == "b"
    assert tenant_label(ReqContext("r", cache_salt="s")) is None
    assert tenant_label(ReqContext("r", kv_transfer_params={"tenant": ""})) is None


def test_tenant_scopes_keys_unless_shared() -> None:
    key = raykv.prefix_keys(list(range(32)), 16)[1]
    isolated = TenantSharing()
    a, b, none = (
        isolated.scope(ReqContext("r", kv_transfer_params=p)) for p in ({"tenant": "a"}, {"tenant": "b"}, None)
    )
    assert none == b"" and tenant_key(key, none) == key  # no tenant: plain keys (and salted requests too)
    assert len({tenant_key(key, a), tenant_key(key, b), key}) == 3  # each tenant its own key
    assert len(tenant_key(key, a)) == len(key) and tenant_key(key, a)[-4:] == key[-4:]  # same shape, group kept
    assert isolated.scope(ReqContext("r", tenant="a")) == a  # ReqContext.tenant names the same tenant
    long_key = b"\x07" * 252 + key[-4:]  # the longest key raykv accepts
    assert len(tenant_key(long_key, a)) == 68
    groups = TenantSharing({"team": ["a", "b"], "other": ["c", "d"]})
    assert groups.shares("a", "b") and groups.shares("c", "d")
    assert not groups.shares("a", "c") and not groups.shares("a", "x") and not groups.shares("a", None)
    assert not groups.shares("x", "y")  # tenants in no group stay isolated
    public = TenantSharing({"team": ["a", "b"], "public": ["*"]})
    assert public.shares("x", "y") and public.shares("x", None) and not public.shares("a", "x")


def test_a_tenant_that_is_not_a_str_is_scoped_never_dropped() -> None:
    """An odd ``tenant`` (a list, a dict, a bool, a float) still keeps its requests apart from
    untenanted ones and from other tenants: it names the tenant its JSON text names."""
    key = raykv.prefix_keys(list(range(32)), 16)[1]
    odd = [["a"], {"team": "a", "n": [1]}, True, False, 2.5]
    scopes = [ISOLATED.scope(ReqContext("r", kv_transfer_params={"tenant": v})) for v in odd]
    assert all(scopes) and len(set(scopes)) == len(odd), scopes  # none is the no-tenant scope b""
    assert len({tenant_key(key, s) for s in scopes} | {key}) == len(odd) + 1
    # the same value names the same tenant, whatever order a dict's keys came in
    assert ISOLATED.scope(ReqContext("r", kv_transfer_params={"tenant": {"n": [1], "team": "a"}})) == scopes[1]
    assert tenant_label(ReqContext("r", kv_transfer_params={"tenant": ["a"]})) == '["a"]'
    assert tenant_of(ReqContext("r", kv_transfer_params={"tenant": {"team": "a", "n": [1]}})) == '{"n":[1],"team":"a"}'
    assert tenant_label(ReqContext("r", kv_transfer_params={"tenant": None})) is None
    assert tenant_label(ReqContext("r", kv_transfer_params={"tenant": 7})) == "7"


def test_engine_salt_scopes_labelled_tenants_and_no_client_salt_forges_one() -> None:
    groups = TenantSharing({"team": ["a", "b"], "public": ["*"]})
    a, b, x = (groups.scope_of_tenant(t) for t in ("a", "b", "x"))
    c = TenantSharing().scope_of_tenant("c")
    assert engine_salt(None, b"") is None and engine_salt("s", b"") == "s"  # no label: the request's own salt
    assert engine_salt(None, a) == engine_salt(None, b) != engine_salt(None, TenantSharing().scope_of_tenant("a"))
    assert engine_salt(None, x) is None and engine_salt("s", x) == "s"  # a '*' tenant shares with everyone
    assert engine_salt("s", a) != engine_salt(None, a)  # the label and the salt both count
    forged = engine_salt(None, c)
    assert forged is not None and forged.startswith(SALT_PREFIX)
    assert engine_salt(forged, b"") != forged  # a client sending a tenant's salt gets another one
    salts = [engine_salt(s, sc) for s in (None, "s", forged, SALT_PREFIX, "raykv:t:") for sc in (b"", a, c)]
    assert len(set(salts)) == len(salts)  # one to one


@pytest.mark.parametrize(
    "shared, field, words",
    [
        (["a", "b"], "shared_tenants", "must be dict"),
        ({"g": "a,b"}, "shared_tenants.g", "must be a list of tenant names"),
        ({"g": ["a"]}, "shared_tenants.g", ">= 2 tenants"),
        ({"g": ["a", ""]}, "shared_tenants.g", "non-empty strings"),
        ({"g": ["a", 3]}, "shared_tenants.g", "non-empty strings"),
        ({"g": ["a", "*"]}, "shared_tenants.g", "only entry"),
        ({"g": ["a", "b"], "h": ["b", "c"]}, "shared_tenants.h", "already in group 'g'"),
        ({"": ["a", "b"]}, "shared_tenants", "group names"),
    ],
)
def test_bad_shared_tenants_name_the_field(shared, field, words) -> None:
    with pytest.raises(ConfigError) as e:
        RaykvConfig.from_dict({"shared_tenants": shared})
    assert e.value.field == field and words in str(e.value), str(e.value)
    RaykvConfig.from_dict({"shared_tenants": {"g": ["a", "b"], "all": ["*"]}})


def test_victims_respect_other_tenants_quotas() -> None:
    lru = TenantLRU({"a": 100, "b": 100})
    lru.add(b"b1", "b", 50)  # b: within its quota, and the oldest key of all
    for i in range(3):
        lru.add(b"a%d" % i, "a", 40)
    lru.add(b"x1", "x", 10)  # x: no quota
    lru.touch([b"a0"])  # a's LRU order: a1, a2, a0
    assert lru.own_victim("a", 0) == b"a1"  # a holds 120 > 100: its own oldest first
    assert lru.own_victim("b", 50) is None  # b fits its quota
    assert lru.shared_victim("b") == b"a1"  # over-quota a, not b's own and never b's for a
    lru.discard(b"a1")
    lru.discard(b"a2")  # a: 40, within quota; x has no quota
    assert lru.shared_victim("a") == b"x1"
    lru.discard(b"x1")
    assert lru.shared_victim("a") == b"a0"  # only a's own is left to it: b is protected
    assert lru.shared_victim(None) is None
    assert lru.bytes_by_tenant() == {"a": 40, "b": 50}


def test_pack_index_evicts_by_tenant_and_reports_no_room() -> None:
    """The object store's index: whole packs of the right tenant go; a store that would need
    another tenant's in-quota blocks finds no room (the actor then fails it)."""
    from tiers.object_store.packing import Pack, PackIndex

    idx = PackIndex(16 * BLOCK, {"a": 12 * BLOCK, "b": 12 * BLOCK})  # quotas oversubscribe the capacity
    ids = iter(range(100))

    def add(tenant: str, n: int) -> list[bytes]:
        keys = [b"%s-%d" % (tenant.encode(), next(ids)) for _ in range(n)]
        idx.evict_for(n * BLOCK, tenant)
        idx.add(Pack(next(ids), None, keys, BLOCK, [n * BLOCK], tenant))
        return keys

    b_keys = add("b", 10)
    a1 = add("a", 4)
    assert idx.used == 14 * BLOCK
    evicted, packs = idx.evict_for(4 * BLOCK, "a")  # full: a's own oldest pack goes, never b's
    assert evicted == a1 and len(packs) == 1 and idx.used + 4 * BLOCK <= idx.capacity
    add("a", 4)
    evicted, _ = idx.evict_for(8 * BLOCK, "a")  # a's all 4 go and still no room: b is within quota
    assert len(evicted) == 4 and idx.used + 8 * BLOCK > idx.capacity
    assert all(k in idx for k in b_keys)
    assert idx.tenants.bytes_by_tenant() == {"b": 10 * BLOCK}
    with pytest.raises(ValueError, match="quota"):
        idx.evict_for(13 * BLOCK, "a")


@pytest.mark.parametrize(
    "quotas, problem",
    [
        ({"a": 0}, "int >= 1"),
        ({"a": True}, "int >= 1"),
        ({"": 5}, "non-empty"),
        ({"a": "1G"}, "tenant 'a': size unit 'G' is ambiguous"),  # sizes are taken: "1GiB" (test_units.py)
        ({"a": 1.5}, "tenant 'a': must be a whole number of bytes"),
    ],
)
def test_bad_quotas_name_the_field(quotas, problem) -> None:
    for tier in ({"type": "object_store"}, {"type": "fs", "root": "/tmp/x"}):
        with pytest.raises(ConfigError, match=rf"tiers\[0\]\.tenant_quotas: .*{problem}"):
            RaykvConfig.from_dict({"tiers": [{**tier, "tenant_quotas": quotas}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.tenant_quotas: must be dict"):
        RaykvConfig.from_dict({"tiers": [{"type": "object_store", "tenant_quotas": [1]}]})


def _burst(tier, region, quota_blocks: int) -> tuple[list[LookupResult], list[bytes]]:
    """Tenant b (named by cache_salt) stores blocks within its quota, tenant a (kv_transfer_params)
    bursts 5x the tier's capacity in jobs of 4 blocks; returns b's lookups and what b loads back."""
    rng = np.random.default_rng(1)
    region.array[:] = rng.integers(0, 256, region.array.shape, dtype=np.uint8)
    b = TierDriver(tier)
    b.req = ReqContext("b-req", cache_salt="tenant-b")
    b_keys = raykv.prefix_keys(list(range(16 * quota_blocks)), 16, salt="b")
    assert b.store(b_keys, list(range(quota_blocks))).success
    want = [region.array[i].tobytes() for i in range(quota_blocks)]
    a = TierDriver(tier)
    a.req = ReqContext("a-req", kv_transfer_params={"tenant": "tenant-a"})
    a_keys = raykv.prefix_keys(list(range(16 * 80)), 16, salt="a")
    for i in range(0, 80, 4):
        assert a.store(a_keys[i : i + 4], list(range(16, 20))).success  # a's quota evicts a's own blocks
    tier.services.lookup_cache.invalidate(b_keys)
    hits = b.lookup(b_keys)
    ok = b.load(b_keys, list(range(32, 32 + quota_blocks))).success
    got = [region.array[32 + i].tobytes() for i in range(quota_blocks)] if ok else []
    return hits, [g for g, w in zip(got, want) if g == w]


@pytest.fixture(scope="module")
def services(ray_local, tmp_path_factory):
    svc = raykv.start({"namespace": NS, "directory_shards": 2})
    yield svc
    svc.shutdown()


@pytest.mark.parametrize("kind", ["object_store", "fs"])
def test_burst_of_one_tenant_leaves_the_other_tenants_blocks(services, tmp_path_factory, kind) -> None:
    quota_blocks = 8
    per_block = BLOCK if kind == "object_store" else BLOCK + 4096  # fs: the file header (< 4 KiB)
    cfg = {
        "type": kind,
        "capacity_bytes": 2 * quota_blocks * per_block,
        "tenant_quotas": {"tenant-a": quota_blocks * per_block, "tenant-b": quota_blocks * per_block},
    }
    if kind == "fs":
        cfg.update(root=str(tmp_path_factory.mktemp("fs-root")), fsync=False)
    else:
        cfg.update(namespace=NS)
    region = PrimaryRegion(48, BLOCK)
    try:
        tier = TierFactory.create_tier(cfg, region.view, services=services)
        assert ray.get(tier.actor.stats.remote()).figures["tenant_quotas"] == cfg["tenant_quotas"]
        hits, loaded = _burst(tier, region, quota_blocks)
        assert hits == [LookupResult.HIT] * quota_blocks
        assert len(loaded) == quota_blocks  # every byte of b's blocks came back
        stats = ray.get(tier.actor.stats.remote()).figures
        assert set(stats["tenant_bytes"]) == {"tenant-a", "tenant-b"}
        assert stats["tenant_bytes"]["tenant-a"] <= quota_blocks * per_block
        status = collect_status(services, metrics=False)
        text = format_status(status)
        assert "bytes per tenant" in text and "tenant-a" in text and "tenant-b" in text, text
        tier.shutdown()
    finally:
        region.close()


def test_without_quotas_the_burst_evicts_the_other_tenant(services, tmp_path_factory) -> None:
    """The same burst on a tier with no quotas: one shared LRU, b's blocks go (why quotas exist)."""
    root = str(tmp_path_factory.mktemp("fs-root-shared"))
    cfg = {"type": "fs", "root": root, "fsync": False, "capacity_bytes": 16 * (BLOCK + 4096)}
    region = PrimaryRegion(48, BLOCK)
    try:
        tier = TierFactory.create_tier(cfg, region.view, services=services)
        hits, _ = _burst(tier, region, 8)
        assert hits.count(LookupResult.HIT) < 8
        tier.shutdown()
    finally:
        region.close()


@pytest.fixture(scope="module")
def sharing_services(ray_local):
    """A namespace whose config opts tenant-c and tenant-d into sharing."""
    svc = raykv.start({"namespace": NS + "-sharing", "directory_shards": 1, "shared_tenants": SHARED})
    yield svc
    svc.shutdown()


@pytest.mark.parametrize("kind", ["object_store", "fs", "example"])
def test_tenants_named_by_kv_transfer_params_share_only_by_opt_in(sharing_services, tmp_path_factory, kind) -> None:
    """The same prompt stored for tenant-a: tenant-b (and a request naming no
    tenant) miss it and cannot load it; tenant-c's blocks do reach tenant-d,
    the pair the namespace's shared_tenants opts in."""
    cfg: dict = {"type": kind}
    if kind == "fs":
        cfg.update(root=str(tmp_path_factory.mktemp("fs-root-isolation")), fsync=False)
    elif kind == "object_store":
        cfg.update(namespace=NS + "-sharing")
    services = sharing_services
    keys = raykv.prefix_keys(list(range(7000, 7000 + 16 * 6)), 16)  # no salt: only the tenant label differs
    with PrimaryRegion(16, BLOCK) as region:
        region.array[:6] = np.arange(6, dtype=np.uint8)[:, None] + 1
        tier = TierFactory.create_tier(cfg, region.view, services=services)
        if kind == "example":  # a process-local tier: no services, so the opt-in is handed to it
            tier.tenant_sharing = TenantSharing(SHARED)
        try:
            drivers = {}
            for t in ("tenant-a", "tenant-b", "tenant-c", "tenant-d", None):
                drivers[t] = TierDriver(tier, f"req-{t}")
                drivers[t].req = ReqContext(f"req-{t}", kv_transfer_params={"tenant": t} if t else None)
            assert drivers["tenant-a"].store(keys, list(range(6))).success
            assert drivers["tenant-c"].store(keys, list(range(6))).success
            hit, miss = [LookupResult.HIT] * 6, [LookupResult.MISS] * 6
            assert drivers["tenant-a"].lookup(keys) == hit  # the test can tell a hit from a miss
            assert drivers["tenant-b"].lookup(keys) == miss
            assert drivers[None].lookup(keys) == miss
            res = drivers["tenant-b"].load(keys, list(range(8, 14)))
            assert not res.success and not res.successful_keys and not region.array[8:14].any()
            assert drivers["tenant-d"].lookup(keys) == hit  # opted in: c's blocks
            assert drivers["tenant-d"].load(keys, list(range(8, 14))).success
            assert (region.array[8:14] == region.array[:6]).all()
            if kind != "example":  # the directory lists a's and c's copies, each under its own keys
                held = services.directory.prefix_lookup([tier.scope(k, drivers["tenant-a"].req) for k in keys]).num_keys
                assert held == 6
                assert services.directory.prefix_lookup([tier.scope(k) for k in keys]).num_keys == 0
        finally:
            tier.shutdown()
