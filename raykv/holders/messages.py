"""What a holder actor reports, typed on both sides (``raykv status``, tools, tests).

Its data-path answers and announcements are ``raykv.core.wire`` types
(``StoreAnswer``, ``LoadAnswer``, ``HolderReady``, ``HoldingsPage``,
``HolderInfo``); a tier's own messages live in its package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.core.wire import Report


@dataclass(frozen=True)
class HolderStats:
    """A holder actor's ``stats()``: what every holder reports, and its tier's own figures."""

    holder_id: str
    started_at: float
    #: Held blocks per KV identity tag (hex).
    blocks_by_identity: dict[str, int]
    #: The tier's own figures (``tier_stats``: blocks, bytes, capacity, counters, ...).
    figures: Report = field(default_factory=dict)

    def report(self) -> Report:
        """Everything as one flat JSON object (``raykv status --json``)."""
        by_identity: Report = {tag: n for tag, n in self.blocks_by_identity.items()}
        common: Report = {"holder_id": self.holder_id, "blocks_by_identity": by_identity, "started_at": self.started_at}
        return {**common, **self.figures}
