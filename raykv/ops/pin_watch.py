"""Pinned blocks per tier actor, read from their stats, and waiting for them to settle.

The engines offload a request's blocks after it answered, asynchronously,
so ``raykv warm`` waits for the pins its requests cause: it reads every
tier actor's ``pinned_blocks`` / ``pinned_bytes`` (``raykv.core.pins``) until
they stop growing (``wait_settled``), within a time limit: it never hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ray

from raykv.core.wire import HolderInfo
from raykv.holders.messages import HolderStats
from raykv.services.cluster import RaykvServices


@dataclass(frozen=True)
class PinCount:
    """One tier actor's pinned blocks and bytes."""

    holder_id: str
    tier_type: str
    node_id: str | None
    blocks: int
    nbytes: int


#: Tier actor -> its pins (``read_pins``).
Pins = dict[str, PinCount]


def _as_int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def read_pins(services: RaykvServices, timeout: float = 10.0) -> Pins:
    """Pins of every tier actor of ``services``' namespace that keeps pins (its
    stats have ``pinned_bytes``). Actors that do not answer are left out."""
    infos: list[HolderInfo] = services.holders(timeout)
    calls: dict[str, tuple[HolderInfo, ray.ObjectRef[HolderStats]]] = {}
    for info in infos:
        try:
            actor = ray.get_actor(info.actor_name, namespace=services.namespace)
        except ValueError:  # gone since the control actor listed it
            continue
        calls[info.holder_id] = (info, actor.stats.remote())
    out: Pins = {}
    for holder_id, (info, ref) in calls.items():
        try:
            figures = ray.get(ref, timeout=timeout).figures
        except Exception:  # noqa: BLE001 - a dead or busy holder: its pins are not counted
            continue
        if "pinned_bytes" in figures:
            blocks, nbytes = _as_int(figures.get("pinned_blocks")), _as_int(figures.get("pinned_bytes"))
            out[holder_id] = PinCount(holder_id, info.tier_type, info.node_id, blocks, nbytes)
    return out


def growth(before: Mapping[str, PinCount], after: Mapping[str, PinCount]) -> Pins:
    """Per tier actor of ``after``: the blocks and bytes pinned since ``before``."""
    out: Pins = {}
    for holder_id, now in after.items():
        was = before.get(holder_id)
        blocks = now.blocks - (was.blocks if was else 0)
        nbytes = now.nbytes - (was.nbytes if was else 0)
        out[holder_id] = PinCount(holder_id, now.tier_type, now.node_id, blocks, nbytes)
    return out


#: How ``wait_settled`` ended.
SETTLED = "settled"
NOTHING_NEW = "nothing new pinned"
TIMED_OUT = "timed out"


@dataclass(frozen=True)
class Settling:
    """How long ``wait_settled`` waits: ``settle_s`` without change after pins grew;
    ``quiet_s`` without any growth at all; ``limit_s`` in all; polling every ``interval_s``."""

    settle_s: float = 3.0
    quiet_s: float = 15.0
    limit_s: float = 120.0
    interval_s: float = 0.25


def wait_settled(
    read: Callable[[], Pins],
    before: Pins,
    settling: Settling | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[Pins, str]:
    """Poll ``read`` until the pins stop growing; the last reading and how it ended
    (``SETTLED``, ``NOTHING_NEW`` or ``TIMED_OUT``)."""
    settling = settling or Settling()
    start = changed = clock()
    last = read()
    while True:
        now = clock()
        grew = any(p.blocks > 0 for p in growth(before, last).values())
        if grew and now - changed >= settling.settle_s:
            return last, SETTLED
        if not grew and now - changed >= settling.quiet_s:
            return last, NOTHING_NEW
        if now - start >= settling.limit_s:
            return last, TIMED_OUT
        sleep(settling.interval_s)
        reading = read()
        if reading != last:
            last, changed = reading, clock()
