"""What the control actor reports, typed on both sides (``raykv status``, tools, tests).

Holders, identities, rules and the config cross as their own types
(``HolderInfo``, ``KVIdentity``, ``PolicyRule``, ``RaykvConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControlStats:
    """The control actor's ``stats()``."""

    #: Calls per method name.
    calls: dict[str, int]
    rules_version: int
    #: Holders announced now.
    holders: int
