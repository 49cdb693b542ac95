"""Directory shards that were killed for good and started again under their names.

Ray restarts a crashed shard in place (``max_restarts=-1``): callers keep their
handles. A shard killed without restart (``ray.kill``'s default, ``no_restart=True``)
is gone; the control actor starts it again (``start_missing_shards``),
or the next ``raykv start`` / engine attach does, and that is a new actor with the
same name. A caller that kept the old handle would call a dead actor forever: its
registrations lost, its lookups of that shard's keys missing. Callers that see
``ActorDiedError`` from a shard put the actor named for it now in its place (``replace_in``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError

from raykv.core import naming
from raykv.core.named import find_actor, named_actor, raykv_running, successor

logger = logging.getLogger(__name__)

#: Seconds between the control actor's checks that every shard is alive.
SHARD_CHECK_S = 2.0
#: Least seconds between two lookups of one shard's successor by one caller.
HEAL_EVERY_S = 1.0


def live_shard(namespace: str, index: int) -> ActorHandle | None:
    """The actor named for shard ``index`` now (None: no live actor has the name)."""
    return find_actor(naming.directory_shard(index), namespace)


def replace_in(shards: list[ActorHandle], namespace: str, index: int) -> bool:
    """Put the actor named for shard ``index`` now in ``shards[index]`` when it is another one
    than that handle (not when the same actor is restarting in place, or none is started yet);
    whether it did. A blocking GCS lookup: call it off the event loop."""
    live = successor(shards[index], naming.directory_shard(index), namespace)
    if live is None:
        return False
    shards[index] = live
    return True


async def take_replacement(
    shards: list[ActorHandle], namespace: str, index: int, error: BaseException, counts: Counter[str]
) -> None:
    """After ``error`` from ``shards[index]``: if it is ``ActorDiedError``, ``replace_in`` (off
    the event loop), counting a replacement in ``counts["shards_replaced"]``."""
    if isinstance(error, ActorDiedError) and await asyncio.to_thread(replace_in, shards, namespace, index):
        counts["shards_replaced"] += 1
        logger.info("directory shard %d was started again as a new actor: calling it from now on", index)


def while_running(namespace: str, start: Callable[[], ActorHandle]) -> Callable[[], ActorHandle | None]:
    """``start`` (``start_agent`` with its arguments), only while raykv's control actor lives in
    ``namespace`` (None after ``raykv stop``: a caller's failed call must not start an agent
    behind it; engines attach again once raykv is started)."""

    def restart() -> ActorHandle | None:
        return start() if raykv_running(namespace) else None

    return restart


def start_missing_shards(namespace: str, num_shards: int) -> list[int]:
    """Start every shard of ``namespace`` that has no live actor; their indices. A started
    shard rebuilds its entries from the holders (``DirectoryShard``), as after a crash."""
    from raykv.directory.shard import DirectoryShard

    started = []
    for i in range(num_shards):
        if live_shard(namespace, i) is not None:
            continue
        named_actor(DirectoryShard, naming.directory_shard(i), namespace, i, num_shards, namespace)
        started.append(i)
    if started:
        logger.warning(
            "directory shard(s) %s of namespace %r were gone (killed without restart): started them again; "
            "their entries come back from the holders",
            started,
            namespace,
        )
    return started
