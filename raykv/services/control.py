"""The control actor: one namespace's config, policy rules, holder list and KV identities.

It is not the directory: directory shards (``raykv.directory``) map keys to
holders. The control actor knows *which holders exist* (each announces
itself here and at every shard, and leaves when it dies), so a restarting
shard knows whom to ask for its entries, and tools (``raykv status``,
``invalidate``, ``shutdown``) know whom to reach. Engines read the config and
long-poll the rules (``raykv.policy.cache``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
import warnings
from collections import Counter

import ray
from ray.actor import ActorHandle

from raykv.config.options import RaykvConfig
from raykv.core.identity import KVIdentity
from raykv.core.wire import HolderInfo
from raykv.directory.replaced import SHARD_CHECK_S, start_missing_shards
from raykv.metrics import status_log
from raykv.policy import PolicyRule
from raykv.policy.messages import RulesAnswer
from raykv.services.messages import ControlStats, StartRole
from raykv.services.rules_store import (
    RulesCheckpoint,
    load_added_tiers,
    load_rules,
    mark_stopping,
    save_added_tiers,
    save_rules,
)

logger = logging.getLogger(__name__)


def restarted_by_ray() -> bool:
    """Whether Ray restarted this actor after a crash (call it inside the actor).

    Ray 2.60's ``was_current_actor_reconstructed`` reads its own deprecated ``actor_id`` property,
    so every call printed Ray's "Use get_actor_id() instead" warning in the driver's console at
    each ``raykv start``: the deprecated call is Ray's, not raykv's, so that one warning is dropped.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*Use get_actor_id\(\) instead", category=DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


#: How long a failed first start may take to stop what it started (``close_if_alone``);
#: past it, its stop is taken to have died with its process and the services stay.
STOPPING_S = 60.0


def _hold(rules: dict[str, PolicyRule], rule: PolicyRule) -> str:
    """Put ``rule`` in ``rules`` under its name (replacing a rule of that name), or under the
    first free ``rule-N`` when it has none (never another rule's); the name."""
    name, n = rule.name, len(rules)
    while not name:
        name, n = (f"rule-{n}" if f"rule-{n}" not in rules else ""), n + 1
    rules[name] = dataclasses.replace(rule, name=name)
    return name


@ray.remote(num_cpus=0, max_restarts=-1)
class ControlActor:
    """Named ``raykv-control``: the source of truth engines attach to."""

    def __init__(self, config: RaykvConfig, starter: str = "") -> None:
        self._config = config
        #: The start that created this actor (``join``), whether another start joined it
        #: since, and until when a failed first start is stopping it (``time.time()``).
        self._starter = starter
        self._others_joined = False
        self._stopping_until: float | None = None
        self._rules: dict[str, PolicyRule] = {}
        self._version = 0
        self._changed = asyncio.Event()
        self._readers: Counter[int] = Counter()  # waiting long polls per rules version
        self._holders: dict[str, HolderInfo] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}  # holder id -> its raykv_watch call
        #: KV identities engines announced: tag (hex) -> identity
        self._identities: dict[str, KVIdentity] = {}
        self.calls: Counter[str] = Counter()
        for i, raw in enumerate(config.rules):
            _hold(self._rules, PolicyRule.from_dict(raw, f"rules[{i}]"))
        if self._rules:
            self._version = 1
        self._incarnation = uuid.uuid4().hex
        reconstructed = self._reconstructed = restarted_by_ray()
        #: Tiers starts added (``add_tiers``), kept in the GCS for a restart.
        self._added_tiers: list[dict[str, object]] = []
        if reconstructed:
            self._added_tiers = load_added_tiers(config.namespace)
            self._config = dataclasses.replace(config, tiers=[*config.tiers, *self._added_tiers])
        else:
            save_added_tiers(config.namespace, [])  # a fresh start: a crashed run's are not ours
        kept = load_rules(config.namespace) if reconstructed else None
        if kept is not None:  # restarted after a crash: the rules as they were (``rules_store``)
            self._rules, self._version = dict(kept.rules), kept.version
        else:
            self._keep_rules()  # a fresh start: what a restart will start from
        #: Restarted by Ray after a crash: engines may give back rules newer than those kept
        #: (``restore_rules``), with the operator's changes made here since replayed over them.
        self._restorable = reconstructed
        self._changed_since_restart: dict[str, PolicyRule | None] = {}  # name -> rule (None: removed)
        self._restored_version = self._version if kept is not None else 0  # the newest taken back
        self._status_log = status_log.spawn(self.status_line, interval_s=float(config.status_log_s))
        self._shard_keeper = asyncio.get_running_loop().create_task(self._keep_shards())

    def __repr__(self) -> str:
        # What it serves only (the dashboard records it once); works when __init__ raised early.
        config = self.__dict__.get("_config")
        if not isinstance(config, RaykvConfig):
            return "RaykvControl(shards=?, namespace '?')"
        shards, namespace = config.directory_shards, config.namespace
        return f"RaykvControl(shards={shards}, namespace {namespace!r})"

    def status_line(self) -> str:
        """Live holders, rules and calls, one line (logged every ``status_log_s``)."""
        holders = ", ".join(sorted(self._holders)) or "none"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(self.calls.items()))
        return f"control: holders [{holders}]; rules {len(self._rules)} v{self._version}; calls: {calls}"

    async def _keep_shards(self) -> None:
        """Start again any directory shard killed for good (``raykv.directory.replaced``)."""
        config = self._config
        while True:
            await asyncio.sleep(SHARD_CHECK_S)
            if self._stopping():  # a failed first start is killing them
                continue
            try:
                started = await asyncio.to_thread(start_missing_shards, config.namespace, config.directory_shards)
            except Exception as e:  # the GCS busy or restarting: the next round tries again
                logger.debug("shard check failed: %r", e)
                continue
            self.calls["shards_started"] += len(started)

    def _stopping(self) -> bool:
        return self._stopping_until is not None and time.time() < self._stopping_until

    async def join(self, token: str) -> StartRole:
        """A ``raykv start`` (``token``, one per call) joins this raykv: FIRST for the start
        that created this actor, JOINED for any other (and for any after a restart: who
        joined before it is not known), CLOSING while a failed first start stops it."""
        self.calls["join"] += 1
        if self._stopping():
            return StartRole.CLOSING
        self._stopping_until = None  # (a stop that outlived STOPPING_S died with its start)
        self._others_joined |= token != self._starter
        return StartRole.FIRST if token == self._starter and not self._reconstructed else StartRole.JOINED

    async def close_if_alone(self, token: str) -> bool:
        """Whether the failed first start ``token`` may stop this raykv: no other start
        joined it. Then starts that join are told CLOSING, for at most ``STOPPING_S``,
        and the GCS notes the stop (``rules_store.mark_stopping``) before this answers."""
        self.calls["close_if_alone"] += 1
        if token != self._starter or self._others_joined or self._reconstructed:
            return False
        self._stopping_until = time.time() + STOPPING_S
        mark_stopping(self._config.namespace, self._stopping_until)
        return True

    async def config(self) -> RaykvConfig:
        self.calls["config"] += 1
        return self._config

    async def add_tiers(self, tiers: list[dict[str, object]]) -> RaykvConfig:
        """Note tiers a ``raykv start`` started (``tiers``: its config's, already listed
        ones left out; the actor is created with none); the config with them. Kept in the
        GCS, written before this answers: a restart after a crash has them too."""
        self.calls["add_tiers"] += 1
        tiers = [t for t in tiers if t not in self._config.tiers]  # (two starts racing list one once)
        if tiers:
            self._added_tiers = [*self._added_tiers, *tiers]
            save_added_tiers(self._config.namespace, self._added_tiers)
            self._config = dataclasses.replace(self._config, tiers=[*self._config.tiers, *tiers])
        return self._config

    async def add_rule(self, rule: PolicyRule) -> int:
        """Add (or replace, by name) a policy rule; returns the new rules version."""
        self.calls["add_rule"] += 1
        name = _hold(self._rules, rule)
        if self._restorable:
            self._changed_since_restart[name] = self._rules[name]
        return self._bump()

    async def remove_rule(self, name: str) -> int:
        self.calls["remove_rule"] += 1
        if self._restorable:  # (an engine's copy may still hold it)
            self._changed_since_restart[name] = None
        if self._rules.pop(name, None) is not None:
            return self._bump()
        return self._version

    def _bump(self) -> int:
        """A new rules version: kept for a restart, then the long polls wake."""
        self._version += 1
        self._keep_rules()
        self._changed.set()
        self._changed = asyncio.Event()
        return self._version

    def _keep_rules(self) -> None:
        save_rules(self._config.namespace, RulesCheckpoint(self._version, dict(self._rules)))

    async def rules(self) -> tuple[int, list[PolicyRule]]:
        self.calls["rules"] += 1
        return self._version, list(self._rules.values())

    async def wait_rules(self, known_version: int, timeout_s: float) -> RulesAnswer:
        """Long poll: return when the rules differ from ``known_version`` or after ``timeout_s``."""
        self.calls["wait_rules"] += 1
        if known_version == self._version:
            self._readers[known_version] += 1
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
            finally:
                self._readers[known_version] -= 1
                if not self._readers[known_version]:
                    del self._readers[known_version]
        return RulesAnswer(self._version, list(self._rules.values()), self._incarnation)

    async def restore_rules(self, version: int, rules: list[PolicyRule]) -> bool:
        """An engine's rules (``version``, counted by the actor before this one was restarted
        after a crash, which lost the rules added at run time): taken when newer than any
        given back before, with the operator's adds and removals since the restart made
        again over them (an operator's change wins). Whether they were taken."""
        self.calls["restore_rules"] += 1
        if not self._restorable or version <= self._restored_version:
            return False
        self._restored_version = version
        taken: dict[str, PolicyRule] = {}
        for rule in rules:
            _hold(taken, rule)
        for name, changed in self._changed_since_restart.items():
            if changed is None:
                taken.pop(name, None)
            else:
                taken[name] = changed
        self._rules = taken
        self._version = max(self._version, version)  # newer than every engine's copy and this actor's
        self._bump()
        logger.warning(
            "control actor restarted: took back %d policy rule(s), version %d, from an engine, "
            "with %d change(s) made here since",
            len(rules),
            version,
            len(self._changed_since_restart),
        )
        return True

    async def rules_readers(self) -> list[int]:
        """The rules version each engine's waiting long poll holds (one entry
        per poll): every engine holds rules version ``v`` once all are >= v."""
        return sorted(self._readers.elements())

    async def add_holder(self, info: HolderInfo, handle: ActorHandle | None = None) -> None:
        """A holder (re)announced itself. With its ``handle`` it is watched
        (``raykv_watch``) and leaves the list when it dies; a restarted holder
        announces itself again."""
        self.calls["add_holder"] += 1
        holder_id = info.holder_id
        self._holders[holder_id] = info
        old = self._watches.pop(holder_id, None)
        if old is not None:
            old.cancel()
        if handle is not None:
            self._watches[holder_id] = asyncio.get_running_loop().create_task(self._watch(holder_id, info, handle))

    async def _watch(self, holder_id: str, info: HolderInfo, handle: ActorHandle) -> None:
        try:
            await handle.raykv_watch.remote()
        except asyncio.CancelledError:
            raise
        except Exception:  # it died (or its node did); a restart re-announces it
            pass
        if self._holders.get(holder_id) is info:  # not re-announced meanwhile
            await self.remove_holder(holder_id)

    async def remove_holder(self, holder_id: str) -> None:
        """Forget a holder (it died; its directory entries left with it)."""
        self.calls["remove_holder"] += 1
        self._holders.pop(holder_id, None)
        task = self._watches.pop(holder_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def register_identity(self, tag_hex: str, identity: KVIdentity) -> None:
        """An engine's KV identity (so status and invalidation can name it)."""
        self.calls["register_identity"] += 1
        self._identities[tag_hex] = identity

    async def identities(self) -> dict[str, KVIdentity]:
        return dict(self._identities)

    async def holders(self) -> list[HolderInfo]:
        return list(self._holders.values())

    async def stats(self) -> ControlStats:
        return ControlStats(calls=dict(self.calls), rules_version=self._version, holders=len(self._holders))

    async def ping(self) -> bool:
        return True
