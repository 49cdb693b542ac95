"""Progress of one fs store or load job: one outcome per block, set by I/O threads."""

from __future__ import annotations

import threading
from typing import NamedTuple

from raykv.core.contract import TransferJob
from tiers.fs import format as fmt

#: Outcome kinds. Stores: WRITTEN, EXISTING (file already there) or ERROR;
#: loads: OK, MISSING (no file), CORRUPT (failed verification) or ERROR.
WRITTEN, EXISTING, OK, MISSING, CORRUPT, ERROR = "written", "existing", "ok", "missing", "corrupt", "error"


class Outcome(NamedTuple):
    """What happened to one block of a job."""

    kind: str
    #: File size (WRITTEN, EXISTING) or bytes read (OK).
    size: int = 0
    #: What went wrong (the failed kinds).
    detail: str = ""


class BlockJob:
    """A job's scoped keys, primary chunks and per-key outcomes; ``done`` is True exactly once."""

    __slots__ = ("job", "keys", "chunks", "outcomes", "_left", "_lock", "error")

    def __init__(self, job: TransferJob, keys: list[bytes], chunks: list[int]) -> None:
        self.job = job
        self.keys = keys
        self.chunks = chunks
        self.outcomes: list[Outcome] = [Outcome(ERROR, detail="not run")] * len(keys)
        self._left = len(keys)
        self._lock = threading.Lock()
        self.error: str | None = None

    def done(self, i: int, outcome: Outcome) -> bool:
        """Record block ``i``'s outcome; True for the last block of the job."""
        with self._lock:
            self.outcomes[i] = outcome
            self._left -= 1
            return self._left == 0

    def with_kind(self, *kinds: str) -> list[int]:
        """Positions of the blocks whose outcome is one of ``kinds``."""
        return [i for i, o in enumerate(self.outcomes) if o.kind in kinds]

    def summary(self, idx: list[int], what: str) -> str:
        """``n of m keys <what>: <key>: <kind> (<detail>); ...`` for the blocks ``idx``."""
        # Name each key by its own bytes (a scoped key opens with the identity tag, the same for all).
        parts = [
            f"{self.keys[i][fmt.TAG_BYTES :].hex()[:12]}: {self.outcomes[i].kind} ({self.outcomes[i].detail})"
            for i in idx[:3]
        ]
        more = f"; +{len(idx) - 3} more" if len(idx) > 3 else ""
        return f"{len(idx)} of {len(self.keys)} keys {what}: " + "; ".join(parts) + more
