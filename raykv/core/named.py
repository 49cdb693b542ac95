"""raykv's named, detached actors: found by name, or started under it."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import ray
from ray.actor import ActorHandle

from raykv.core import naming

if TYPE_CHECKING:
    from ray.actor import ActorClass


def find_actor(name: str, namespace: str) -> ActorHandle | None:
    """The live actor named ``name`` in ``namespace`` (None: no live actor has the name)."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def named_actor(cls: type, name: str, namespace: str, *args: object) -> ActorHandle:
    """The detached actor ``name`` of ``namespace``, started from ``cls(*args)`` when missing."""
    remote_cls = cast("ActorClass[object]", cls)  # what @ray.remote made it (mypy ignores class decorators)
    handle = remote_cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(*args)
    assert isinstance(handle, ActorHandle)  # Ray's stubs also allow the class itself
    return handle


def raykv_running(namespace: str) -> bool:
    """Whether raykv's control actor lives in ``namespace`` (``raykv stop`` kills it first)."""
    return find_actor(naming.CONTROL_ACTOR, namespace) is not None


def successor(actor: object, name: str, namespace: str) -> ActorHandle | None:
    """The live actor named ``name`` now when it is another one than ``actor`` (None: the same
    actor, restarting in place, or none started yet). A blocking GCS lookup."""
    live = find_actor(name, namespace)
    return None if live is None or live == actor else live


def killed_for_good(actor: object, name: str, namespace: str) -> bool:
    """Whether ``actor``, once named ``name``, was killed for good while raykv runs in
    ``namespace``: no live actor has the name now, or another one does. Not after ``raykv
    stop`` (its control actor is gone; engines attach again once raykv is started), and not
    while Ray restarts ``actor`` in place (the name still resolves to it). Blocking GCS
    lookups: call it off the scheduler thread."""
    return raykv_running(namespace) and find_actor(name, namespace) != actor
