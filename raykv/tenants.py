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

Each tenant keeps its own LRU order; with no quotas configured the tiers keep
their plain LRU and only count bytes per tenant.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from raykv.contract import ReqContext
from raykv.policy.rules import request_tenant

DEFAULT_TENANT = ""
EVERY_TENANT = "*"


def tenant_of(req: ReqContext | None) -> str:
    """The tenant a request's blocks are charged to."""
    if req is None:
        return DEFAULT_TENANT
    tenant = request_tenant(req)
    if tenant is None and req.cache_salt is not None:
        tenant = str(req.cache_salt)
    return tenant or DEFAULT_TENANT


def check_quotas(value: Any) -> str | None:
    """``opt(check=...)`` for a ``tenant_quotas`` option."""
    for tenant, quota in dict(value).items():
        if not isinstance(tenant, str) or not tenant:
            return f"tenant names must be non-empty strings ('*' = every tenant not listed); got {tenant!r}"
        if isinstance(quota, bool) or not isinstance(quota, int) or quota < 1:
            return f"the quota of tenant {tenant!r} must be an int >= 1 (bytes); got {quota!r}"
    return None


def tenant_quotas_option(held: str, where: str) -> Any:
    """A tier's ``tenant_quotas`` option: ``held`` names what a quota counts
    (e.g. "bytes of block files under the root"), ``where`` when it applies."""
    from raykv.config import opt

    return opt(
        {},
        kind=dict,
        check=check_quotas,
        doc=f"{held} each tenant may keep, each tenant with its own LRU: {{'tenant-a': 1073741824, '*': ...}} "
        "('*': every tenant not listed); a tenant over quota evicts its own blocks first, never another "
        f"tenant's within its quota. Tenant: kv_transfer_params['tenant'], else cache_salt. {where}",
    )


def fmt_tenants(by_tenant: Mapping[str, int]) -> str:
    """``; tenants a 1.0 MiB, (none) 2.0 MiB`` for status lines ('' when no tenant but the default holds bytes)."""
    from raykv.units import fmt_bytes

    if set(by_tenant) <= {DEFAULT_TENANT}:
        return ""
    return "; tenants " + ", ".join(f"{t or '(none)'} {fmt_bytes(b)}" for t, b in by_tenant.items())


class TenantLRU:
    """Keys per tenant in LRU order, bytes per tenant, and the victims quotas allow."""

    def __init__(self, quotas: Mapping[str, int] | None = None) -> None:
        self.quotas = dict(quotas or {})
        self._lru: dict[str, OrderedDict[bytes, int]] = {}  # tenant -> key -> last-use stamp
        self._owner: dict[bytes, tuple[str, int]] = {}  # key -> (tenant, bytes)
        self._bytes: dict[str, int] = {}
        self._clock = itertools.count()

    def __contains__(self, key: bytes) -> bool:
        return key in self._owner

    def quota(self, tenant: str) -> int | None:
        return self.quotas.get(tenant, self.quotas.get(EVERY_TENANT))

    def used(self, tenant: str) -> int:
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
        lru = self._lru.setdefault(tenant, OrderedDict())
        lru[key] = next(self._clock)
        lru.move_to_end(key)

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            owner = self._owner.get(key)
            if owner is not None:
                lru = self._lru[owner[0]]
                lru[key] = next(self._clock)
                lru.move_to_end(key)

    def discard(self, key: bytes) -> None:
        owner = self._owner.pop(key, None)
        if owner is not None:
            tenant, nbytes = owner
            self._bytes[tenant] -= nbytes
            lru = self._lru[tenant]
            del lru[key]
            if not lru:
                del self._lru[tenant], self._bytes[tenant]

    def _over(self, tenant: str, extra: int = 0) -> bool:
        quota = self.quota(tenant)
        return quota is not None and self.used(tenant) + extra > quota

    def own_victim(self, tenant: str, nbytes: int) -> bytes | None:
        """``tenant``'s oldest key while it holds more than its quota leaves room for ``nbytes``."""
        lru = self._lru.get(tenant)
        if lru and self._over(tenant, nbytes):
            return next(iter(lru))
        return None

    def shared_victim(self, tenant: str | None) -> bytes | None:
        """The oldest key of a tenant with no quota or over it; else ``tenant``'s own oldest; else None."""
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
