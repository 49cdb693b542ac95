"""Progress of one fs store or load job: one outcome per block, set by I/O threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
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


_NOT_RUN = Outcome(ERROR, detail="not run")


class BlockJob:
    """A job's scoped keys, primary chunks and per-key outcomes; ``done`` is True exactly once.

    A job past its deadline is ``expire``d: the blocks not finished yet fail at once, and
    an I/O thread still at work on one (a hung mount) may no longer touch the job's
    primary slots, which vLLM reuses once the job failed: ``with_slots`` runs a copy
    only while the job lives."""

    __slots__ = (
        "job",
        "keys",
        "chunks",
        "outcomes",
        "deadline",
        "expired",
        "_left",
        "_busy",
        "_late",
        "_lock",
        "error",
    )

    def __init__(self, job: TransferJob, keys: list[bytes], chunks: list[int], deadline: float = float("inf")) -> None:
        self.job = job
        self.keys = keys
        self.chunks = chunks
        self.outcomes: list[Outcome] = [_NOT_RUN] * len(keys)
        #: ``time.monotonic()`` past which the job is ``expire``d.
        self.deadline = deadline
        self.expired = False
        self._left = len(keys)
        self._busy = [False] * len(keys)  # an I/O thread is at work on the block
        self._late: set[int] = set()  # blocks an I/O thread was at work on when the job expired
        self._lock = threading.Lock()
        self.error: str | None = None

    def start(self, i: int) -> bool:
        """An I/O thread takes block ``i``: False when the job expired (nothing to do)."""
        with self._lock:
            self._busy[i] = not self.expired
            return self._busy[i]

    def with_slots(self, copy: Callable[[], None]) -> bool:
        """Run ``copy`` (to or from the job's primary slots) unless the job expired; whether it ran."""
        with self._lock:
            if self.expired:
                return False
            copy()
            return True

    def done(self, i: int, outcome: Outcome) -> bool | None:
        """Record block ``i``'s outcome; True for the last block of the job. After ``expire``
        the outcome is dropped (the block failed then): None for a block an I/O thread was at
        work on at the expiry (its late return), else False."""
        with self._lock:
            self._busy[i] = False
            if self.expired:
                if i in self._late:
                    self._late.discard(i)
                    return None
                return False
            self.outcomes[i] = outcome
            self._left -= 1
            return self._left == 0

    def expire(self, detail: str) -> int | None:
        """Fail every block not done yet, with ``detail``; None when the job had ended, else
        how many blocks an I/O thread is still at work on (each ends with a ``done`` call)."""
        with self._lock:
            if self.expired or self._left == 0:
                return None
            self.expired = True
            for i, o in enumerate(self.outcomes):
                if o is _NOT_RUN:
                    self.outcomes[i] = Outcome(ERROR, detail=detail)
            self._left = 0
            self._late = {i for i, busy in enumerate(self._busy) if busy}
            return len(self._late)

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
