"""Ray actor handles as raykv's callers see them: typed by the calls they make.

``ray.actor.ActorHandle`` answers every attribute with ``Never`` (Ray builds
its methods at run time), so mypy treats the code after a call through it as
unreachable and checks none of it. A caller that types its handle with one of
these protocols instead keeps its code checked; any ``ActorHandle`` of an
actor with those methods is one. The answers are ``ObjectRef[object]``:
callers check what they got (``isinstance`` against the ``raykv.core.wire``
message they expect).
"""

from __future__ import annotations

from typing import Protocol

import ray


class RemoteMethod(Protocol):
    """An actor method on a handle: ``.remote(...)`` sends the call."""

    def remote(self, *args: object, **kwargs: object) -> ray.ObjectRef[object]: ...


class WatchableHandle(Protocol):
    """A ``raykv.holders.holder_actor.WatchableActor``: a call that never returns while it lives, and a ping."""

    @property
    def raykv_watch(self) -> RemoteMethod: ...
    @property
    def raykv_ping(self) -> RemoteMethod: ...


class HolderHandle(WatchableHandle, Protocol):
    """A holder actor (``raykv.holders.holder_actor.HolderActor``) as engines call it.

    ``ready()`` answers ``HolderReady``; ``events_since(since, tag)`` answers
    ``HoldingsPage``; any other attribute is one of its tier's methods."""

    @property
    def ready(self) -> RemoteMethod: ...
    @property
    def events_since(self) -> RemoteMethod: ...
    def __getattr__(self, name: str) -> RemoteMethod:
        """Its tier's own methods (``store``, ``load``, ``stats``, ...)."""
        ...


class ConfigSource(Protocol):
    """The control actor as its namespace's readers of settings call it: ``config()``
    answers the ``raykv.config.options.RaykvConfig`` it runs with."""

    @property
    def config(self) -> RemoteMethod: ...
