"""The engine's copy of the namespace's policy rules (``on_new_request`` never waits on the network)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError

from raykv.core.background import SessionEnded, wait_answer
from raykv.core.contract import ReqContext, RequestOffloadingContext
from raykv.core.node import ray_session
from raykv.policy.messages import RulesAnswer
from raykv.policy.rules import PolicyRule, decide

logger = logging.getLogger(__name__)


class PolicyCache:
    """The namespace's policy rules, kept fresh by a background long poll.

    ``decide`` answers from memory: no directory call per request.

    The long poll also tells whether raykv still runs: the control actor is
    restarted by Ray when it crashes, so a call that finds it dead for good
    (``ActorDiedError``) means raykv was stopped (``raykv stop``). Then, once a
    second, ``find_control`` looks for a new control actor under the name; one
    that answers is ``successor`` (raykv was started again) and the poll ends:
    the process's tiers attach to the new services (``raykv.engine.reattach``).

    A control actor that Ray restarted in place after a crash answers with
    another ``incarnation``: it forgot the engines' identities, and the rules
    added at run time if it could not keep them in the GCS
    (``raykv.services.rules_store``). The cache then offers it its rules
    (``restore_rules``, taken only when newer than what it has) and calls
    ``on_control_restart`` (the services announce their identities again).
    """

    def __init__(
        self,
        control: ActorHandle,
        refresh_s: float = 5.0,
        find_control: Callable[[], ActorHandle | None] | None = None,
        on_control_restart: Callable[[], None] | None = None,
    ) -> None:
        self._control = control
        self._on_control_restart = on_control_restart
        self._incarnation: str | None = None
        #: Times the control actor was found restarted in place (a crash).
        self.control_restarts = 0
        self.refresh_s = refresh_s
        self.version = -1
        self.rules: list[PolicyRule] = []
        self._find_control = find_control
        #: Set once the control actor was found dead for good (raykv stopped).
        self.control_gone = False
        #: A live control actor of a raykv started again after ``control_gone``.
        self.successor: ActorHandle | None = None
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
                poll: ray.ObjectRef[RulesAnswer] = self._control.wait_rules.remote(self.version, self.refresh_s)
                answer: RulesAnswer = wait_answer(poll, self.refresh_s + 30, session)
                if self._incarnation is not None and answer.incarnation != self._incarnation:
                    self._incarnation = answer.incarnation
                    self._control_restarted(session)
                    continue  # ask again: the rules given back, or the restarted actor's own
                self._incarnation = answer.incarnation
                if answer.version != self.version:
                    with self._changed:
                        self.version, self.rules = answer.version, answer.rules
                        self._changed.notify_all()
            except SessionEnded:
                return
            except Exception as e:
                if self._stop.is_set() or not ray.is_initialized():
                    return
                if isinstance(e, ActorDiedError) and self._find_control is not None:
                    if not self.control_gone:
                        logger.warning(
                            "raykv's control actor is gone (raykv stopped?): this engine's raykv tiers miss "
                            "until raykv is started again, then attach to it"
                        )
                    self.control_gone = True
                    if self._found_successor(session):
                        return
                else:
                    logger.debug("policy refresh failed: %r", e)
                self._stop.wait(min(self.refresh_s, 1.0))

    def _control_restarted(self, session: str | None) -> None:
        """Give the control actor, restarted after a crash, what it forgot."""
        self.control_restarts += 1
        logger.warning(
            "raykv's control actor restarted after a crash: giving it back this engine's rules and identities"
        )
        if self.version >= 0:
            try:
                wait_answer(self._control.restore_rules.remote(self.version, list(self.rules)), 30.0, session)
            except SessionEnded:
                raise
            except Exception as e:  # noqa: BLE001 - the next poll takes the restarted actor's rules
                logger.warning("could not give the rules back to raykv's control actor: %r", e)
        if self._on_control_restart is not None:
            try:
                self._on_control_restart()
            except Exception as e:  # noqa: BLE001 - status and invalidation miss this engine's identity
                logger.warning("could not announce this engine's identities again: %r", e)

    def _found_successor(self, session: str | None) -> bool:
        """Whether a new control actor runs under the name and answers (sets ``successor``)."""
        assert self._find_control is not None
        try:
            found = self._find_control()
            if found is None:
                return False
            wait_answer(found.wait_rules.remote(-1, 0.0), 30.0, session)
        except SessionEnded:  # Ray shut down in this process: the poll ends
            self._stop.set()
            return False
        except Exception as e:  # not (yet) a live one: look again later
            logger.debug("no live control actor yet: %r", e)
            return False
        self.successor = found
        logger.warning("raykv was started again: this engine's raykv tiers attach to it")
        return True

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
