"""The engine's copy of the namespace's policy rules (``on_new_request`` never waits on the network)."""

from __future__ import annotations

import logging
import threading

import ray
from ray.actor import ActorHandle

from raykv.core.background import SessionEnded, wait_answer
from raykv.core.contract import ReqContext, RequestOffloadingContext
from raykv.core.node import ray_session
from raykv.policy.rules import PolicyRule, decide

logger = logging.getLogger(__name__)


class PolicyCache:
    """The namespace's policy rules, kept fresh by a background long poll.

    ``decide`` answers from memory: no directory call per request.
    """

    def __init__(self, control: ActorHandle, refresh_s: float = 5.0) -> None:
        self._control = control
        self.refresh_s = refresh_s
        self.version = -1
        self.rules: list[PolicyRule] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-policy-refresh", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        session = ray_session()
        while not self._stop.is_set():
            if ray_session() != session:  # Ray shut down (or another session began): ours is over
                return
            try:
                poll: ray.ObjectRef[tuple[int, list[PolicyRule]]] = self._control.wait_rules.remote(
                    self.version, self.refresh_s
                )
                version, rules = wait_answer(poll, self.refresh_s + 30, session)
                if version != self.version:
                    with self._changed:
                        self.version, self.rules = version, rules
                        self._changed.notify_all()
            except SessionEnded:
                return
            except Exception as e:
                if self._stop.is_set() or not ray.is_initialized():
                    return
                logger.debug("policy refresh failed: %r", e)
                self._stop.wait(min(self.refresh_s, 1.0))

    def decide(self, tier_type: str, req: ReqContext) -> RequestOffloadingContext:
        return decide(self.rules, tier_type, req)

    @property
    def refreshing(self) -> bool:
        """Whether the background long poll still runs (False once ``close`` returned)."""
        return self._thread.is_alive()

    def wait_version(self, version: int, timeout: float = 10.0) -> bool:
        """Block until the cache holds rules of at least ``version`` (tests, tools)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.version >= version, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the long poll and wait for its thread: a thread still inside a
        Ray call when the process runs ``ray.shutdown()`` can crash it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
