"""``AnswerStore``: the directory answers one engine process keeps, per key.

Answers expire after ``ttl_s`` and at most ``max_entries`` are kept (least
recently used ones go first: a dropped answer costs one more lookup, never a
wrong answer). Stores of our own that register while a key's lookup is on its
way are held here and joined to that answer when it lands.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from raykv.core.wire import HolderInfo


class AnswerStore:
    """Key -> (when answered, holders). Not thread-safe: ``LookupCache`` calls it under its lock."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._answers: OrderedDict[bytes, tuple[float, list[HolderInfo]]] = OrderedDict()
        #: holders of our own stores that registered while the key's lookup was in flight
        self._stored_in_flight: dict[bytes, list[HolderInfo]] = {}
        self.evicted = 0  # answers dropped to stay within max_entries

    def __len__(self) -> int:
        return len(self._answers)

    def __contains__(self, key: bytes) -> bool:
        return key in self._answers

    def get(self, key: bytes) -> list[HolderInfo] | None:
        """The fresh answer for ``key`` (None: none, or expired)."""
        answer = self._answers.get(key)
        if answer is None:
            return None
        at, holders = answer
        if self._clock() - at > self.ttl_s:
            del self._answers[key]
            return None
        self._answers.move_to_end(key)
        return holders

    def put(self, keys: Sequence[bytes], answers: Sequence[list[HolderInfo]]) -> None:
        """Keep the answers of a lookup, with our stores noted while it was on its way."""
        now = self._clock()
        cache = self._answers
        stored: dict[bytes, list[HolderInfo]] = {}
        if self._stored_in_flight:  # every key's entry leaves, also of keys not kept below
            stored = {k: self._stored_in_flight.pop(k) for k in keys if k in self._stored_in_flight}
        if len(keys) >= self.max_entries:  # only the last ones can stay
            cache.clear()
            self.evicted += len(keys) - self.max_entries
            keys, answers = keys[-self.max_entries :], answers[-self.max_entries :]
        for k, holders in zip(keys, answers):
            cache[k] = (now, holders)
            cache.move_to_end(k)
        for k, ours in stored.items():
            if k in cache:
                at, holders = cache[k]
                cache[k] = (at, holders + [h for h in ours if h not in holders])
        over = len(cache) - self.max_entries
        self.evicted += max(0, over)
        for _ in range(over):
            cache.popitem(last=False)

    def add_holder(self, key: bytes, holder: HolderInfo) -> bool:
        """Add ``holder`` to ``key``'s answer; False when no answer is kept for it."""
        cached = self._answers.get(key)
        if cached is None:
            return False
        if holder not in cached[1]:
            self._answers[key] = (cached[0], [*cached[1], holder])
        return True

    def hold_for_answer(self, key: bytes, holder: HolderInfo) -> None:
        """``holder`` stored ``key`` after its lookup left: ``put`` adds it to that answer."""
        self._stored_in_flight.setdefault(key, []).append(holder)

    def invalidate(self, key: bytes, tier_type: str | None = None) -> None:
        """Forget ``key``'s answer: only its ``tier_type`` holders when given, else all of it."""
        cached = self._answers.get(key)
        if cached is None:
            return
        rest = [h for h in cached[1] if tier_type is not None and h.tier_type != tier_type]
        if rest:
            self._answers[key] = (cached[0], rest)
        else:
            self._answers.pop(key, None)
