"""``AgentState``: a node agent's view and where it stands in each shard's change feed.

Plain Python, no Ray (``raykv.directory.agent`` is the actor around it).

Order rules, so the view converges on the shards' state:

- feed entries are applied in each shard's order; a gap (the shard restarted,
  or the agent fell behind its bounded feed) resets the whole view, since a
  known key's later changes can no longer be followed, and every shard's
  local holders are read again;
- a shard's lookup answer carries the feed position it was taken at: it is
  kept only when the view has not yet applied entries past it (those entries,
  applied later, replay onto it in order). An older answer still answers the
  engine that asked, but is not kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from raykv.core.wire import HolderInfo, LookupReply
from raykv.directory.messages import FeedOp, FeedPage
from raykv.directory.view import NodeView

#: Recent replica lags kept for the percentiles.
LAG_SAMPLES = 4096


@dataclass
class FeedPosition:
    """Where the view stands in one shard's feed (epoch 0: not followed yet)."""

    epoch: int = 0
    seq: int = 0


class AgentState:
    """The view plus one ``FeedPosition`` per shard."""

    def __init__(self, view: NodeView, num_shards: int) -> None:
        self.view = view
        self.positions = [FeedPosition() for _ in range(num_shards)]
        self.feed_entries = 0
        self.gaps = 0
        self.lags: deque[float] = deque(maxlen=LAG_SAMPLES)
        self.lag_count = 0  # lags observed, ever
        self._lags_taken = 0  # ... of which ``new_lags`` handed out

    def apply(self, shard: int, page: FeedPage, asked: FeedPosition | None = None) -> list[int]:
        """Apply one page of ``shard``'s feed, asked for after ``asked`` (None: the
        current position); returns the shards whose holders' keys must be read
        again (``holders_to_read``, ``register``).

        Pages come from ``changes`` and ride on ``apply`` replies, so two may
        overlap: a page asked for from an older position keeps only its entries
        past the current one, and its gap (if any) is left to the next call."""
        pos = self.positions[shard]
        if asked is not None and (asked.epoch, asked.seq) != (pos.epoch, pos.seq):
            if page.gap or page.epoch != pos.epoch or page.seq <= pos.seq:
                return []
            page = FeedPage(page.epoch, page.seq, tuple(e for e in page.entries if e.seq > pos.seq))
        if page.gap:
            self.gaps += 1
            followed = [i for i, p in enumerate(self.positions) if p.epoch]
            if pos.epoch:  # it changed while we could not follow it: forget what it told us
                self.view.reset()
            self.positions[shard] = FeedPosition(page.epoch, page.seq)
            for info in page.holders:
                self.view.slot(shard, info)
            return sorted({shard, *followed}) if pos.epoch else [shard]
        now = time.time()
        view = self.view
        for entry in page.entries:
            if entry.op == FeedOp.REGISTER:
                view.register(shard, entry.holder_id, entry.fps)
            elif entry.op == FeedOp.UNREGISTER:
                view.unregister(shard, entry.holder_id, entry.fps)
            elif entry.op == FeedOp.ADD_HOLDER and entry.info is not None:
                view.slot(shard, entry.info)
            elif entry.op == FeedOp.DROP_HOLDER:
                view.drop_holder(shard, entry.holder_id)
            if entry.at:
                self.lags.append(now - entry.at)
                self.lag_count += 1
        self.feed_entries += len(page.entries)
        pos.seq = max(pos.seq, page.seq)
        return []

    def lost(self, shard: int) -> list[int]:
        """``shard`` cannot be followed (its actor is down): the view is reset once
        per outage; returns the other shards whose local holders must be read again."""
        if not self.positions[shard].epoch:
            return []
        self.positions[shard] = FeedPosition()
        self.gaps += 1
        self.view.reset()
        return [i for i, p in enumerate(self.positions) if p.epoch]

    def holders_to_read(self, shard: int) -> list[HolderInfo]:
        """``shard``'s holders whose keys the view takes whoever asked: this node's,
        or every one when the view follows all keys."""
        listed = self.view.listed(shard)
        return listed if self.view.all_keys else [info for info in listed if self.view.is_local(info)]

    def followed(self) -> bool:
        """Every shard's feed is followed."""
        return all(p.epoch for p in self.positions)

    def answer(self, shard: int, fps: np.ndarray, reply: LookupReply) -> np.ndarray:
        """View set ids for ``shard``'s ``reply`` about ``fps``, kept when in feed order."""
        pos = self.positions[shard]
        if pos.epoch and reply.feed_epoch == pos.epoch and reply.feed_seq >= pos.seq:
            return self.view.learn(shard, fps, reply)
        return self.view.translate(shard, reply)

    def new_lags(self, most: int) -> list[float]:
        """The lags observed since the last call (the latest ``most`` of them: the metrics' round)."""
        new, self._lags_taken = self.lag_count - self._lags_taken, self.lag_count
        return list(self.lags)[-min(new, len(self.lags), most) :] if new > 0 else []

    def lag_percentiles(self) -> tuple[float | None, float | None]:
        """Replica lag p50 and p99 (seconds) of the recent feed entries."""
        if not self.lags:
            return None, None
        lags = np.fromiter(self.lags, dtype=np.float64)
        return float(np.percentile(lags, 50)), float(np.percentile(lags, 99))
