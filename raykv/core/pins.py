"""Pins: blocks a tier keeps past LRU until a deadline (prompt caching with a lifetime).

A request asks for it with ``kv_transfer_params = {"cache_ttl_s": N}``: seconds
> 0, at most ``MAX_CACHE_TTL_S`` (7 days; a larger value is capped, a malformed
one is ignored with a warning like a malformed ``tenant``:
``raykv.core.validate.request_ttl_value``). ``ReqContext.cache_ttl_s`` carries it.

The tiers that keep an LRU (``raykv.core.tenants.TenantLRU``) pin the blocks
such a request stores or touches until ``now + N`` (monotonic, on the tier's
actor): victim selection skips them. A later store or touch with a TTL extends
a pin (the later deadline wins). Once a pin expires the block is an ordinary
LRU entry again, aged from its last use: the next eviction pass takes it if it
is the oldest. A pinned block is never evicted for an unpinned one: when only
pinned blocks (and other tenants' within their quotas) are left, a store fails
as it does when quotas leave nothing evictable. Invalidation by KV identity
and ``unpin`` still remove or release pinned blocks.

Caps, checked when a block is pinned (refusals are counted per reason in the
tier's stats counters, ``REFUSED_COUNTERS``; a refused block is still stored,
unpinned):

- ``tier_cap``: a tier's pinned bytes stay within ``max_pinned_fraction`` of
  its capacity (default 0.5: at least half of a tier keeps serving LRU traffic,
  so a burst of pins cannot turn the cache into a pinned-only store);
- ``tenant_quota``: a tenant's pinned bytes count against its quota (they are
  bytes it holds, and its quota evicts only its unpinned ones), and stay
  within ``max_pinned_fraction`` of it. The same share as the tier's, so that
  a tenant whose pin is refused still has room to cache the block unpinned:
  were its pins allowed its whole quota, its next store would find nothing of
  its own to evict and fail rather than be cached.

Pins live in the tier actor's memory: an actor that restarts (an fs root
rescanning its files) holds its blocks unpinned.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

from raykv.core.fields import opt
from raykv.core.validate import MAX_CACHE_TTL_S, request_params, request_ttl_value
from raykv.core.wire import JsonValue

__all__ = [
    "DEFAULT_MAX_PINNED_FRACTION",
    "MAX_CACHE_TTL_S",
    "REFUSED_COUNTERS",
    "TENANT_QUOTA",
    "TIER_CAP",
    "PinBatch",
    "PinOutcome",
    "PinTable",
    "Unpin",
    "cache_ttl_of",
    "max_pinned_fraction_option",
]

#: Why a pin was refused.
TIER_CAP = "tier_cap"
TENANT_QUOTA = "tenant_quota"
#: Refused blocks per reason, as tier stats counters.
REFUSED_COUNTERS = {TIER_CAP: "pins_refused_tier_cap", TENANT_QUOTA: "pins_refused_tenant_quota"}
#: Share of a tier's capacity its pins may take (``max_pinned_fraction``).
DEFAULT_MAX_PINNED_FRACTION = 0.5
#: Soonest expiries a tier's stats list.
SOONEST = 5


class TtlRequest(Protocol):
    """What pinning reads of a request (``raykv.core.contract.ReqContext`` has it)."""

    @property
    def cache_ttl_s(self) -> float | None: ...
    @property
    def kv_transfer_params(self) -> object: ...


def cache_ttl_of(req: TtlRequest | None) -> float | None:
    """Seconds to pin ``req``'s blocks (``ReqContext.cache_ttl_s``, else
    ``kv_transfer_params['cache_ttl_s']``), or None: unpinned."""
    if req is None:
        return None
    if req.cache_ttl_s is not None:
        return req.cache_ttl_s
    params = request_params(req.kv_transfer_params) or {}
    return request_ttl_value(params.get("cache_ttl_s"))


def check_fraction(value: object) -> str | None:
    """``opt(check=...)`` of ``max_pinned_fraction``: a share of the capacity in [0, 1]."""
    ok = isinstance(value, float) and 0.0 <= value <= 1.0
    return None if ok else f"must be a fraction of the tier's capacity in [0, 1], got {value!r}"


def max_pinned_fraction_option() -> float:
    """A tier's ``max_pinned_fraction`` option."""
    return opt(
        DEFAULT_MAX_PINNED_FRACTION,
        kind=float,
        check=check_fraction,
        doc="largest share (0..1) of the tier's capacity that pinned blocks (kv_transfer_params['cache_ttl_s']) "
        "may take; a pin past it is refused (counted as pins_refused_tier_cap) and the block is cached unpinned. "
        "0 turns pins off. Set when the tier's actor starts",
    )


@dataclass(frozen=True)
class PinBatch:
    """Held keys to pin (or whose pins to extend), each for its TTL in seconds (a tier actor's ``pin``)."""

    keys: tuple[bytes, ...]
    ttls: tuple[float, ...]
    #: An object store actor passes on the pins of keys other nodes' actors hold (the engine's
    #: node actor gets every pin of its requests; a load may have pulled the blocks from another
    #: node). A relayed batch is not relayed again.
    relay: bool = True

    def by_ttl(self) -> dict[float, list[bytes]]:
        """The keys grouped by TTL (the longest wins for a repeated key)."""
        best: dict[bytes, float] = {}
        for k, ttl in zip(self.keys, self.ttls):
            if ttl > 0 and ttl > best.get(k, 0.0):
                best[k] = ttl
        out: dict[float, list[bytes]] = {}
        for k, ttl in best.items():
            out.setdefault(ttl, []).append(k)
        return out


@dataclass(frozen=True)
class Unpin:
    """Which pins a tier actor's ``unpin`` drops: of ``tenants``, of ``keys``,
    or every pin (``everything``). The blocks stay, under plain LRU."""

    tenants: tuple[str, ...] = ()
    keys: tuple[bytes, ...] = ()
    everything: bool = False

    def __post_init__(self) -> None:
        if not (self.tenants or self.keys or self.everything):
            raise ValueError("Unpin names no tenant and no key; pass everything=True to drop every pin")


@dataclass
class PinOutcome:
    """What a pin call did: blocks pinned or extended, blocks refused per reason."""

    pinned: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def count_into(self, counters: MutableMapping[str, int]) -> None:
        """Add it to a tier actor's counters: ``pins_granted`` and the refusals per reason."""
        counters["pins_granted"] = counters.get("pins_granted", 0) + self.pinned
        for why, n in self.refused.items():
            counters[REFUSED_COUNTERS[why]] = counters.get(REFUSED_COUNTERS[why], 0) + n

    def add(self, other: PinOutcome) -> None:
        self.pinned += other.pinned
        for why, n in other.refused.items():
            self.refused[why] = self.refused.get(why, 0) + n


@dataclass
class Pin:
    """One pinned key: whose, how big, until when (monotonic s), and its last use (an LRU stamp)."""

    tenant: str
    nbytes: int
    deadline: float
    stamp: int


class PinTable:
    """Pinned keys with their deadlines, bytes per tenant, and what expired."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._pins: dict[bytes, Pin] = {}
        self._heap: list[tuple[float, bytes]] = []  # (deadline, key); stale entries skipped
        self._bytes: dict[str, int] = {}
        self.total = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, key: bytes) -> Pin | None:
        return self._pins.get(key)

    def used(self, tenant: str) -> int:
        """Pinned bytes of ``tenant``."""
        return self._bytes.get(tenant, 0)

    def bytes_by_tenant(self) -> dict[str, int]:
        return {t: b for t, b in sorted(self._bytes.items()) if b}

    def next_expiry_by_tenant(self) -> dict[str, float]:
        """Seconds until each tenant's soonest pin expiry (0 when already due)."""
        now = self.clock()
        out: dict[str, float] = {}
        for pin in self._pins.values():
            left = max(0.0, pin.deadline - now)
            if left < out.get(pin.tenant, float("inf")):
                out[pin.tenant] = left
        return out

    def holds_tenant(self, tenant: str) -> bool:
        return tenant in self._bytes

    def add(self, key: bytes, pin: Pin) -> None:
        """Pin a key not pinned yet."""
        self._pins[key] = pin
        self._bytes[pin.tenant] = self._bytes.get(pin.tenant, 0) + pin.nbytes
        self.total += pin.nbytes
        heapq.heappush(self._heap, (pin.deadline, key))

    def extend(self, key: bytes, deadline: float) -> None:
        """Move a pin's deadline later (an earlier one changes nothing)."""
        pin = self._pins[key]
        if deadline > pin.deadline:
            pin.deadline = deadline
            heapq.heappush(self._heap, (deadline, key))

    def resize(self, key: bytes, nbytes: int) -> None:
        pin = self._pins[key]
        self._bytes[pin.tenant] += nbytes - pin.nbytes
        self.total += nbytes - pin.nbytes
        pin.nbytes = nbytes

    def pop(self, key: bytes) -> Pin | None:
        """Unpin ``key``; its pin, or None when it had none (its heap entry goes stale)."""
        pin = self._pins.pop(key, None)
        if pin is not None:
            self._bytes[pin.tenant] -= pin.nbytes
            self.total -= pin.nbytes
            if not self._bytes[pin.tenant]:
                del self._bytes[pin.tenant]
        if not self._pins:
            self._heap.clear()
        return pin

    def expired(self) -> list[tuple[bytes, Pin]]:
        """Unpin and return every key whose deadline has passed."""
        now = self.clock()
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, key = heapq.heappop(self._heap)
            pin = self._pins.get(key)
            if pin is not None and pin.deadline == deadline:
                self.pop(key)
                out.append((key, pin))
        return out

    def select(self, which: Unpin) -> list[bytes]:
        """The pinned keys ``which`` names."""
        if which.everything:
            return list(self._pins)
        tenants = set(which.tenants)
        out = [k for k, p in self._pins.items() if p.tenant in tenants] if tenants else []
        return out + [k for k in which.keys if k in self._pins and k not in out]

    def lasting(self, tenant: str | None, seconds: float = 0.0) -> list[bytes]:
        """Keys pinned (for ``tenant``; None: any) whose pins last at least ``seconds`` more, in pin order."""
        until = self.clock() + seconds
        return [k for k, p in self._pins.items() if p.deadline >= until and (tenant is None or p.tenant == tenant)]

    def soonest(self, n: int = SOONEST) -> list[JsonValue]:
        """The ``n`` soonest expiries (keys pinned together share one): tenant,
        seconds left, blocks and bytes."""
        now = self.clock()
        groups: dict[tuple[float, str], list[int]] = {}
        for pin in self._pins.values():
            g = groups.setdefault((pin.deadline, pin.tenant), [0, 0])
            g[0] += 1
            g[1] += pin.nbytes
        out: list[JsonValue] = [
            {"tenant": t, "seconds_left": round(max(0.0, d - now), 3), "blocks": b, "bytes": nb}
            for (d, t), (b, nb) in sorted(groups.items())[:n]
        ]
        return out


def pin_keys(keys: Iterable[bytes]) -> list[list[bytes]]:
    """Each key its own pin group (pinned or refused alone)."""
    return [[k] for k in keys]
