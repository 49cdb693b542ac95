"""What the control actor reports, typed on both sides (``raykv status``, tools, tests).

Holders, identities, rules and the config cross as their own types
(``HolderInfo``, ``KVIdentity``, ``PolicyRule``, ``RaykvConfig``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class ControlStats:
    """The control actor's ``stats()``."""

    #: Calls per method name.
    calls: dict[str, int]
    rules_version: int
    #: Holders announced now.
    holders: int


class StartRole(enum.Enum):
    """What the control actor answers a ``raykv start`` that joins it (``ControlActor.join``)."""

    #: This start created the control actor: it is the namespace's first start.
    FIRST = "first"
    #: raykv already ran, or another start created it.
    JOINED = "joined"
    #: The first start failed and is stopping what it started: start again once it is gone.
    CLOSING = "closing"
