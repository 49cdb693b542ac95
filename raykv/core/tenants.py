"""Per-tenant byte quotas inside one tier: whose a block is, and which block goes first.

A tenant is named by the request (``ReqContext.tenant``, else
``kv_transfer_params["tenant"]``, else its ``cache_salt``); requests that name
none belong to the default tenant ``""``. A tier's ``tenant_quotas`` maps
tenants to byte quotas; ``"*"`` gives every tenant not listed its own quota of
that size, and tenants without a quota share what the quotas leave.

Eviction under quotas (``TenantLRU``), for a store of ``n`` bytes by tenant T:

1. T over its quota (counting the new bytes) evicts its own least recently
   used blocks until it fits in its quota;
2. while the tier lacks room, the victim is the least recently used block among
   tenants that have no quota or are over their quota, and only then T's own
   oldest block. A block of another tenant within its quota is never evicted:
   if nothing else is left the store fails instead.

Each tenant keeps its own LRU order; with no quotas (and no pins) the tiers
keep their plain LRU and only count bytes per tenant. Pinned keys
(``raykv.core.pins``: ``kv_transfer_params["cache_ttl_s"]``) are never victims
until their pin expires; their bytes count against their tenant's quota.

Isolation (``TenantSharing``): a tenant named by a label
(``kv_transfer_params["tenant"]`` or ``ReqContext.tenant``) also scopes the
keys raykv stores and looks up, the way a ``cache_salt`` scopes vLLM's block
hashes: its keys' hash part is replaced by a keyed hash of it (``tenant_key``),
so tenant B's lookups never find tenant A's blocks. A prompt cache shared
across tenants leaks prompts through timing (a hit is faster than a prefill:
CVE-2025-46570), hence isolation by default. Tenants named only by their
``cache_salt`` are scoped by vLLM already (their hashes differ); requests
that name no tenant use plain keys. Sharing is an explicit opt-in in the
namespace config, ``shared_tenants``: ``{"team-x": ["tenant-a", "tenant-b"]}``
makes the tenants of one group share each other's blocks (and only theirs);
``{"public": ["*"]}`` makes every tenant not in another group share with
everyone else and with requests that name no tenant (raykv's behaviour before
tenants were isolated).

The engine's own caches (its prefix cache and vLLM's CPU primary) key blocks
by vLLM's hashes, which know a ``cache_salt`` but not raykv's label: on one
replica, tenant B would hit tenant A's blocks there. So a labelled request's
salt, as the engine hashes it, becomes ``engine_salt``: its tenant scope (and
its own salt), set in the engine process before vLLM hashes the request
(``raykv.integrations.vllm.compat.salt_tenant_requests``); the router hashes
prompts with the same salt.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from raykv.core.fields import opt, size_value
from raykv.core.pins import DEFAULT_MAX_PINNED_FRACTION, TENANT_QUOTA, TIER_CAP, Pin, PinOutcome, PinTable, Unpin
from raykv.core.units import fmt_bytes
from raykv.core.validate import ConfigError, request_params, request_tenant_value, type_name
from raykv.core.wire import Report


class TenantRequest(Protocol):
    """What tenancy reads of a request (``raykv.core.contract.ReqContext`` has it)."""

    @property
    def tenant(self) -> str | None: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def kv_transfer_params(self) -> object: ...


DEFAULT_TENANT = ""
EVERY_TENANT = "*"
#: Bytes at the end of an offload key that are its KV cache group index (kept as is).
_GROUP_IDX_BYTES = 4
#: Longest tenant or group name ``shared_tenants`` accepts.
MAX_TENANT_NAME = 256


def tenant_label(req: TenantRequest | None) -> str | None:
    """The tenant a request names (``ReqContext.tenant``, else
    ``kv_transfer_params['tenant']``), or None; its salt does not count."""
    if req is None:
        return None
    if req.tenant is not None:
        return req.tenant or None
    params = request_params(req.kv_transfer_params) or {}
    return request_tenant_value(params.get("tenant")) or None


def tenant_of(req: TenantRequest | None) -> str:
    """The tenant a request's blocks are charged to: its label, else its ``cache_salt``."""
    if req is None:
        return DEFAULT_TENANT
    tenant = tenant_label(req)
    if tenant is None and req.cache_salt is not None:
        tenant = str(req.cache_salt)
    return tenant or DEFAULT_TENANT


def tenant_key(key: bytes, scope: bytes) -> bytes:
    """``key`` (an offload key: block hash + 4-byte group index) as tenant
    scope ``scope`` stores it: the hash part replaced by a keyed BLAKE2b of
    it (as long as it, at most 64 bytes), the group index kept. An empty
    scope leaves the key as it is."""
    if not scope:
        return key
    head = key[:-_GROUP_IDX_BYTES]
    return hashlib.blake2b(head, digest_size=min(len(head), 64), key=scope).digest() + key[-_GROUP_IDX_BYTES:]


def check_shared_tenants(raw: object, where: str = "shared_tenants") -> dict[str, list[str]]:
    """Validate a ``shared_tenants`` mapping (group -> tenants); ``ConfigError`` names the field."""
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"must be a mapping of group name -> list of tenants, got {type_name(raw)}")
    out: dict[str, list[str]] = {}
    member_of: dict[str, str] = {}
    for group, tenants in raw.items():
        if not isinstance(group, str) or not group or len(group) > MAX_TENANT_NAME:
            raise ConfigError(
                where, f"group names must be non-empty strings of <= {MAX_TENANT_NAME} characters; got {group!r}"[:300]
            )
        field = f"{where}.{group}"
        if not isinstance(tenants, (list, tuple)):
            raise ConfigError(
                field, f"must be a list of tenant names (or ['*']: every tenant), got {type_name(tenants)}"
            )
        names = list(tenants)
        if names == [EVERY_TENANT]:
            pass
        elif EVERY_TENANT in names:
            raise ConfigError(field, "'*' (every tenant not in another group) must be the group's only entry")
        elif len(names) < 2:
            raise ConfigError(field, f"a group shares between >= 2 tenants (or is ['*']); got {names!r}")
        for t in names:
            if not isinstance(t, str) or not t or len(t) > MAX_TENANT_NAME:
                raise ConfigError(
                    field, f"tenant names must be non-empty strings of <= {MAX_TENANT_NAME} characters; got {t!r}"[:300]
                )
            if t in member_of:
                raise ConfigError(
                    field, f"tenant {t!r} is already in group {member_of[t]!r}; a tenant shares within one group"
                )
            member_of[t] = group
        out[group] = names
    return out


class TenantSharing:
    """Which key scope each tenant's blocks live in (``shared_tenants`` of the namespace config).

    ``scope(req)`` is b"" (plain keys) for requests that name no tenant and
    for tenants in a ``['*']`` group; a 32-byte key naming the tenant's group,
    else the tenant itself, otherwise.
    """

    def __init__(self, groups: Mapping[str, list[str]] | None = None) -> None:
        self.groups = check_shared_tenants(dict(groups or {}))
        self._group_of = {t: g for g, ts in self.groups.items() for t in ts}
        self._everyone = EVERY_TENANT in self._group_of
        self._scopes: dict[str, bytes] = {}

    def scope_of_tenant(self, tenant: str | None) -> bytes:
        if not tenant:
            return b""
        scope = self._scopes.get(tenant)
        if scope is None:
            group = self._group_of.get(tenant)
            if group is None and self._everyone:
                scope = b""
            else:
                name = b"group\0" + group.encode() if group is not None else b"tenant\0" + tenant.encode()
                scope = hashlib.blake2b(name, digest_size=32, person=b"raykv-tenant").digest()
            if len(self._scopes) >= 65536:
                self._scopes.clear()
            self._scopes[tenant] = scope
        return scope

    def scope(self, req: TenantRequest | None) -> bytes:
        """The key scope of ``req``'s blocks (b"": plain keys)."""
        return self.scope_of_tenant(tenant_label(req))

    def shares(self, a: str | None, b: str | None) -> bool:
        """Whether tenants ``a`` and ``b`` see each other's blocks."""
        return self.scope_of_tenant(a) == self.scope_of_tenant(b)


#: Every named tenant isolated (no ``shared_tenants``).
ISOLATED = TenantSharing()

#: How every ``cache_salt`` raykv derives starts (``engine_salt``).
SALT_PREFIX = "raykv:"


def engine_salt(salt: str | None, scope: bytes) -> str | None:
    """The ``cache_salt`` the engine hashes a request's blocks with: for a
    request in tenant scope ``scope`` (``TenantSharing.scope``), the scope and
    the request's own ``salt``; otherwise ``salt``. A salt a client sent that
    starts with ``SALT_PREFIX`` is escaped, so no client salt equals a
    tenant's (the map is one-to-one)."""
    if scope:
        return f"{SALT_PREFIX}t:{scope.hex()}" + ("" if salt is None else f":{salt}")
    if salt is not None and salt.startswith(SALT_PREFIX):
        return f"{SALT_PREFIX}u:{salt}"
    return salt


def check_quotas(value: object) -> str | None:
    """``opt(check=...)`` for a ``tenant_quotas`` option."""
    if not isinstance(value, Mapping):
        return f"must be a mapping of tenant -> quota in bytes, got {type_name(value)}"
    for tenant, quota in value.items():
        if not isinstance(tenant, str) or not tenant:
            return f"tenant names must be non-empty strings ('*' = every tenant not listed); got {tenant!r}"
        if isinstance(quota, bool) or not isinstance(quota, int) or quota < 1:
            return f"the quota of tenant {tenant!r} must be an int >= 1 (bytes) or a size such as '8GiB'; got {quota!r}"
    return None


def quotas_in_bytes(value: object) -> object:
    """``opt(convert=...)`` for a ``tenant_quotas`` option: each quota given as a size
    string (``"8GiB"``) as its bytes; anything else as it is (``check_quotas`` follows)."""
    if not isinstance(value, Mapping):
        return value
    out = {}
    for tenant, quota in value.items():
        try:
            out[tenant] = size_value(quota)
        except ValueError as e:
            raise ValueError(f"the quota of tenant {tenant!r}: {e}") from None
    return out


def tenant_quotas_option(held: str, where: str) -> dict[str, int]:
    """A tier's ``tenant_quotas`` option: ``held`` names what a quota counts
    (e.g. "bytes of block files under the root"), ``where`` when it applies."""
    return opt(
        {},
        kind=dict,
        check=check_quotas,
        convert=quotas_in_bytes,
        doc=f"{held} each tenant may keep, each tenant with its own LRU: {{'tenant-a': '1GiB', '*': ...}} "
        "('*': every tenant not listed); a tenant over quota evicts its own blocks first, never another "
        f"tenant's within its quota. Tenant: kv_transfer_params['tenant'], else cache_salt. {where}",
    )


def fmt_tenants(by_tenant: Mapping[str, int]) -> str:
    """``; tenants a 1.0 MiB, (none) 2.0 MiB`` for status lines ('' when no tenant but the default holds bytes)."""

    if set(by_tenant) <= {DEFAULT_TENANT}:
        return ""
    return "; tenants " + ", ".join(f"{t or '(none)'} {fmt_bytes(b)}" for t, b in by_tenant.items())


class TenantLRU:
    """Keys per tenant in LRU order, bytes per tenant, pins, and the victims quotas and pins allow.

    Pinned keys (``raykv.core.pins``) wait outside the LRU order, so no victim
    is ever a pinned key; an expired or dropped pin puts its key back where its
    last use puts it. ``max_pinned_fraction`` caps the pinned bytes at that
    share of the capacity a ``pin`` call names, and a tenant's pinned bytes at
    that share of its quota. ``clock`` (monotonic seconds) times the pins.
    """

    def __init__(
        self,
        quotas: Mapping[str, int] | None = None,
        max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quotas = dict(quotas or {})
        self.max_pinned_fraction = float(max_pinned_fraction)
        self.pins = PinTable(clock)
        self._lru: dict[str, OrderedDict[bytes, int]] = {}  # tenant -> unpinned key -> last-use stamp
        self._owner: dict[bytes, tuple[str, int]] = {}  # key -> (tenant, bytes)
        self._bytes: dict[str, int] = {}
        self._clock = itertools.count()

    def __contains__(self, key: bytes) -> bool:
        return key in self._owner

    def quota(self, tenant: str) -> int | None:
        return self.quotas.get(tenant, self.quotas.get(EVERY_TENANT))

    def used(self, tenant: str) -> int:
        """Bytes ``tenant`` holds, pinned ones included."""
        return self._bytes.get(tenant, 0)

    def bytes_by_tenant(self) -> dict[str, int]:
        return {t: b for t, b in sorted(self._bytes.items()) if b}

    def tenant(self, key: bytes) -> str | None:
        owner = self._owner.get(key)
        return owner[0] if owner else None

    def add(self, key: bytes, tenant: str, nbytes: int) -> None:
        """Charge ``key`` to ``tenant`` (a key held already keeps its tenant; its size is updated)."""
        owner = self._owner.get(key)
        if owner is not None:
            tenant = owner[0]
            self._bytes[tenant] += nbytes - owner[1]
        else:
            self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
        self._owner[key] = (tenant, nbytes)
        pin = self.pins.get(key)
        if pin is not None:
            pin.stamp = next(self._clock)
            self.pins.resize(key, nbytes)
            return
        lru = self._lru.setdefault(tenant, OrderedDict())
        lru[key] = next(self._clock)
        lru.move_to_end(key)

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            owner = self._owner.get(key)
            if owner is None:
                continue
            pin = self.pins.get(key)
            if pin is not None:
                pin.stamp = next(self._clock)
            else:
                lru = self._lru[owner[0]]
                lru[key] = next(self._clock)
                lru.move_to_end(key)

    def discard(self, key: bytes) -> None:
        owner = self._owner.pop(key, None)
        if owner is None:
            return
        tenant, nbytes = owner
        self._bytes[tenant] -= nbytes
        if self.pins.pop(key) is None:
            lru = self._lru[tenant]
            del lru[key]
            if not lru:
                del self._lru[tenant]
        if tenant not in self._lru and not self.pins.holds_tenant(tenant):
            del self._bytes[tenant]

    # -- pins --------------------------------------------------------------------
    def pin(self, groups: Iterable[Sequence[bytes]], ttl_s: float, capacity: int) -> PinOutcome:
        """Pin each group of held keys for ``ttl_s`` seconds from now (keys
        pinned already: until the later deadline). A group is pinned whole or
        refused whole (its new bytes would take the pins over
        ``max_pinned_fraction`` of ``capacity`` (0: no cap), or a tenant's
        pinned bytes over that share of its quota); a refused key stays held,
        unpinned."""
        self.expire()
        out = PinOutcome()
        deadline = self.pins.clock() + ttl_s
        cap = self.max_pinned_fraction * capacity if capacity > 0 else None
        for group in groups:
            held = [k for k in dict.fromkeys(group) if k in self._owner]
            extra: dict[str, int] = {}
            for k in held:
                if k not in self.pins:
                    t, n = self._owner[k]
                    extra[t] = extra.get(t, 0) + n
            why = self._refusal(extra, cap)
            if why is not None:
                out.refused[why] = out.refused.get(why, 0) + sum(1 for k in held if k not in self.pins)
                held = [k for k in held if k in self.pins]  # extended all the same
            for k in held:
                if k in self.pins:
                    self.pins.extend(k, deadline)
                    continue
                t, n = self._owner[k]
                lru = self._lru[t]
                stamp = lru.pop(k)
                if not lru:
                    del self._lru[t]
                self.pins.add(k, Pin(t, n, deadline, stamp))
            out.pinned += len(held)
        return out

    def _refusal(self, extra: Mapping[str, int], cap: float | None) -> str | None:
        """Why pinning ``extra`` more bytes per tenant is refused, or None."""
        if cap is not None and self.pins.total + sum(extra.values()) > cap:
            return TIER_CAP
        for t, n in extra.items():
            quota = self.quota(t)
            if quota is not None and self.pins.used(t) + n > self.max_pinned_fraction * quota:
                return TENANT_QUOTA
        return None

    def expire(self) -> int:
        """Unpin every key whose pin expired (each back in LRU by its last use); how many."""
        return self._release(self.pins.expired())

    def unpin(self, which: Unpin) -> int:
        """Drop the pins ``which`` names (the keys stay, under LRU); how many."""
        self.expire()
        return self._release([(k, p) for k in self.pins.select(which) if (p := self.pins.pop(k)) is not None])

    def _release(self, released: Sequence[tuple[bytes, Pin]]) -> int:
        tenants = set()
        for key, pin in released:
            self._lru.setdefault(pin.tenant, OrderedDict())[key] = pin.stamp
            tenants.add(pin.tenant)
        for t in tenants:
            self._lru[t] = OrderedDict(sorted(self._lru[t].items(), key=lambda kv: kv[1]))
        return len(released)

    def pin_report(self) -> Report:
        """Pinned blocks and bytes, pinned bytes per tenant and the soonest expiries (for tier stats)."""
        self.expire()
        return {
            "pinned_blocks": len(self.pins),
            "pinned_bytes": self.pins.total,
            "tenant_pinned_bytes": {**self.pins.bytes_by_tenant()},
            "max_pinned_fraction": self.max_pinned_fraction,
            "pin_expiries": self.pins.soonest(),
        }

    # -- victims -----------------------------------------------------------------
    def _over(self, tenant: str, extra: int = 0) -> bool:
        quota = self.quota(tenant)
        return quota is not None and self.used(tenant) + extra > quota

    def fits(self, tenant: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more stay within ``tenant``'s quota (pinned bytes count)."""
        return not self._over(tenant, nbytes)

    def own_victim(self, tenant: str, nbytes: int) -> bytes | None:
        """``tenant``'s oldest unpinned key while it holds more than its quota leaves room for ``nbytes``."""
        self.expire()
        lru = self._lru.get(tenant)
        if lru and self._over(tenant, nbytes):
            return next(iter(lru))
        return None

    def oldest(self) -> bytes | None:
        """The oldest unpinned key of any tenant (quotas aside), or None."""
        self.expire()
        firsts = [next(iter(lru.items())) for lru in self._lru.values() if lru]
        return min(firsts, key=lambda kv: kv[1])[0] if firsts else None

    def shared_victim(self, tenant: str | None) -> bytes | None:
        """The oldest unpinned key of a tenant with no quota or over it; else
        ``tenant``'s own oldest unpinned; else None."""
        self.expire()
        best: tuple[int, bytes] | None = None
        for t, lru in self._lru.items():
            if not lru or not (self.quota(t) is None or self._over(t)):
                continue
            key, stamp = next(iter(lru.items()))
            if best is None or stamp < best[0]:
                best = (stamp, key)
        if best is not None:
            return best[1]
        own = self._lru.get(tenant) if tenant is not None else None
        return next(iter(own)) if own else None
