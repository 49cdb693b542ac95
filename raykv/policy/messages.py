"""What the control actor answers to an engine's rules long poll."""

from __future__ import annotations

from dataclasses import dataclass

from raykv.policy.rules import PolicyRule


@dataclass(frozen=True)
class RulesAnswer:
    """The namespace's policy rules as the control actor holds them now."""

    version: int
    rules: list[PolicyRule]
    #: This life of the control actor: another value after Ray restarted it in place
    #: (a crash), which forgets the rules added at run time and the engines' identities.
    incarnation: str
