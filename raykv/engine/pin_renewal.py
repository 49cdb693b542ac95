"""Renewing a request's pins when it arrives, not only when it stores.

A request with ``cache_ttl_s`` keeps its prompt's blocks pinned for that long
after their *last use* (``raykv.core.pins``). A tier pins what a request
stores or touches; but vLLM 0.29-0.33's offloading connector never calls a
tier's ``touch``, and a request whose prefix the engine's own cache or a
load supplies stores nothing. So each such request's prompt keys are touched
once, with its TTL, at the end of the first scheduler step in which the
engine has listed them (``ReqContext.prefix_keys``: vLLM 0.32+; on 0.29 only
stores pin). Touching keys a tier does not hold costs nothing there.
"""

from __future__ import annotations

from raykv.core.contract import ReqContext
from raykv.core.keys import OffloadKey
from raykv.core.pins import cache_ttl_of

#: Steps a request may wait for the engine to list its keys before it is dropped.
MAX_STEPS = 64
#: Most requests waiting at once (the oldest dropped first).
MAX_WAITING = 4096


class PinRenewals:
    """Requests with a TTL whose prompt keys are still to be touched."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[ReqContext, int]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req_context: ReqContext) -> None:
        """A new request: remembered when it asks for a TTL and the engine can list its keys."""
        if req_context.prefix_keys is None or cache_ttl_of(req_context) is None:
            return
        self._waiting[req_context.req_id] = (req_context, 0)
        while len(self._waiting) > MAX_WAITING:
            del self._waiting[next(iter(self._waiting))]

    def due(self) -> list[tuple[ReqContext, list[OffloadKey]]]:
        """At a step's end: the requests whose keys the engine has listed, with them
        (each once); requests still unlisted after ``MAX_STEPS`` steps are dropped."""
        out: list[tuple[ReqContext, list[OffloadKey]]] = []
        for req_id, (req, steps) in list(self._waiting.items()):
            try:
                keys = [OffloadKey(k) for k in req.prefix_keys()] if req.prefix_keys is not None else []
            except Exception:  # noqa: BLE001 - the engine's bookkeeping: the pin waits for a store
                keys = []
            if keys:
                out.append((req, keys))
                del self._waiting[req_id]
            elif steps + 1 >= MAX_STEPS:
                del self._waiting[req_id]
            else:
                self._waiting[req_id] = (req, steps + 1)
        return out
