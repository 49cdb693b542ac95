"""Dropping pins cluster-wide (``raykv unpin``): every tier actor that keeps pins
(``raykv.core.pins``) drops the ones named; the blocks stay, under plain LRU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import ray

from raykv.core.outcomes import answers_within
from raykv.core.pins import Unpin
from raykv.core.wire import HolderInfo, Report


@dataclass
class Unpinned:
    """What ``RaykvServices.unpin`` dropped (``raykv unpin``)."""

    which: Unpin
    #: Pins dropped per holder id (holders that keep pins).
    per_holder: dict[str, int] = field(default_factory=dict)
    #: Holders not reached: holder id -> why.
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def blocks_unpinned(self) -> int:
        return sum(self.per_holder.values())

    def report(self) -> Report:
        """As one JSON object (``raykv unpin --json``)."""
        return {
            "tenants": list(self.which.tenants),
            "keys": [k.hex() for k in self.which.keys],
            "everything": self.which.everything,
            "blocks_unpinned": self.blocks_unpinned,
            "per_holder": {k: v for k, v in self.per_holder.items()},
            "errors": {k: v for k, v in self.errors.items()},
        }


def unpin_everywhere(holders: Sequence[HolderInfo], namespace: str, which: Unpin, timeout: float = 60.0) -> Unpinned:
    """Ask every one of ``holders`` (the tier actors of ``namespace``) that keeps pins to drop those ``which`` names."""
    out = Unpinned(which)
    calls: dict[str, ray.ObjectRef[int]] = {}
    for info in holders:
        try:
            actor = ray.get_actor(info.actor_name, namespace=namespace)
        except ValueError:  # gone since the control actor listed it
            continue
        unpin = getattr(actor, "unpin", None)  # engine caches and pending holders keep no pins
        if unpin is not None:
            calls[info.holder_id] = unpin.remote(which)
    for holder_id, answer in answers_within(calls, timeout).items():
        if isinstance(answer, int):
            out.per_holder[holder_id] = answer
        else:  # a dead holder's blocks (and pins) went with it; a hung one's: no answer in `timeout`
            out.errors[holder_id] = repr(answer)
    return out
