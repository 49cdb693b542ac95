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
import uuid
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
from raykv.services.messages import ControlStats

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1)
class ControlActor:
    """Named ``raykv-control``: the source of truth engines attach to."""

    def __init__(self, config: RaykvConfig) -> None:
        self._config = config
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
            rule = PolicyRule.from_dict(raw, f"rules[{i}]")
            self._rules[rule.name or f"rule-{i}"] = rule
        if self._rules:
            self._version = 1
        self._incarnation = uuid.uuid4().hex
        #: Restarted by Ray after a crash: engines may give back the rules added at run time
        #: (``restore_rules``) until an operator changes the rules here.
        self._restorable = ray.get_runtime_context().was_current_actor_reconstructed
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
            try:
                started = await asyncio.to_thread(start_missing_shards, config.namespace, config.directory_shards)
            except Exception as e:  # the GCS busy or restarting: the next round tries again
                logger.debug("shard check failed: %r", e)
                continue
            self.calls["shards_started"] += len(started)

    async def config(self) -> RaykvConfig:
        self.calls["config"] += 1
        return self._config

    async def add_rule(self, rule: PolicyRule) -> int:
        """Add (or replace, by name) a policy rule; returns the new rules version."""
        self.calls["add_rule"] += 1
        self._restorable = False
        name = rule.name or f"rule-{len(self._rules)}"
        self._rules[name] = dataclasses.replace(rule, name=name)
        return self._bump()

    async def remove_rule(self, name: str) -> int:
        self.calls["remove_rule"] += 1
        self._restorable = False
        if self._rules.pop(name, None) is not None:
            return self._bump()
        return self._version

    def _bump(self) -> int:
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        return self._version

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
        """An engine's rules (``version``) from before this actor was restarted after a crash,
        which lost the rules added at run time: taken when newer than this actor's and no
        operator changed the rules since the restart. Whether they were taken."""
        self.calls["restore_rules"] += 1
        if not self._restorable or version <= self._version:
            return False
        self._rules = {rule.name or f"rule-{i}": rule for i, rule in enumerate(rules)}
        self._version = version - 1
        self._bump()
        logger.warning(
            "control actor restarted: took back %d policy rule(s), version %d, from an engine", len(rules), version
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
