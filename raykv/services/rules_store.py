"""The control actor's run-time state, kept in the GCS's key-value store: its policy
rules, the tiers ``raykv start`` calls added, and whether a failed first start
is stopping it.

Ray restarts a crashed control actor in place, with only its constructor's
config: the rules an operator added or removed at run time, and the tiers each
start added, would be gone. The control actor writes them here at start and at each
change, before it answers, and a restarted actor starts from them: the rules'
version counts on, so engines follow it without a gap. Ray Serve's controller keeps its state in the
same store (``ray.serve._private.storage.kv_store.RayInternalKVStore``).

Ray has no public API for this store (checked with Ray 2.60): these are the
``ray.experimental.internal_kv`` calls Serve uses.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass

from ray.experimental import internal_kv

from raykv.policy.rules import PolicyRule

logger = logging.getLogger(__name__)

#: The GCS key-value namespace of raykv's keys (one key per raykv namespace).
KV_NAMESPACE = "raykv"


@dataclass(frozen=True)
class RulesCheckpoint:
    """A control actor's policy rules and their version, as last written."""

    version: int
    rules: dict[str, PolicyRule]  # by name, as the control actor holds them


def _key(namespace: str) -> str:
    return f"control-rules/{namespace}"


def _tiers_key(namespace: str) -> str:
    return f"control-added-tiers/{namespace}"


def _stopping_key(namespace: str) -> str:
    return f"control-stopping/{namespace}"


_MISSING = object()


def _put(key: str, value: object, what: str) -> None:
    """Write ``value`` under ``key`` (a GCS error is logged, naming ``what``)."""
    try:
        internal_kv._internal_kv_put(key, pickle.dumps(value), True, namespace=KV_NAMESPACE)
    except Exception as e:  # the GCS busy or restarting
        logger.warning("could not keep %s in the GCS: %r", what, e)


def _get(key: str, what: str) -> object:
    """What was written under ``key``; ``_MISSING`` when nothing was, or it cannot be read."""
    try:
        raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        return _MISSING if raw is None else pickle.loads(raw)
    except Exception as e:  # the GCS unreachable, or written by another raykv release
        logger.warning("could not read %s from the GCS: %r", what, e)
        return _MISSING


def _drop(key: str, what: str) -> None:
    try:
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    except Exception as e:
        logger.warning("could not remove %s from the GCS: %r", what, e)


def save_rules(namespace: str, checkpoint: RulesCheckpoint) -> None:
    """Write ``checkpoint`` for ``namespace`` (a GCS error is logged: the engines'
    give-back, ``restore_rules``, is then what a restart has)."""
    _put(_key(namespace), checkpoint, f"raykv's policy rules v{checkpoint.version}")


def load_rules(namespace: str) -> RulesCheckpoint | None:
    """The rules last written for ``namespace``; None when there are none or they
    cannot be read (written by another raykv release, or the GCS unreachable)."""
    checkpoint = _get(_key(namespace), "raykv's policy rules")
    if checkpoint is _MISSING:
        return None
    if not isinstance(checkpoint, RulesCheckpoint):
        logger.warning("ignoring raykv's policy rules in the GCS: not a RulesCheckpoint")
        return None
    return checkpoint


def drop_rules(namespace: str) -> None:
    """Forget ``namespace``'s rules (``raykv stop``: the next start begins from its config)."""
    _drop(_key(namespace), "raykv's policy rules")


def save_added_tiers(namespace: str, tiers: list[dict[str, object]]) -> None:
    """Write the tier configs starts added to ``namespace``'s config (``add_tiers``; a GCS
    error is logged: a restart after a crash then lists none of them)."""
    _put(_tiers_key(namespace), list(tiers), "the tiers added to raykv")


def load_added_tiers(namespace: str) -> list[dict[str, object]]:
    """The tier configs last written for ``namespace`` (none when there are none or
    they cannot be read)."""
    tiers = _get(_tiers_key(namespace), "the tiers added to raykv")
    if tiers is _MISSING:
        return []
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        logger.warning("ignoring the tiers added to raykv in the GCS: not a list of tier configs")
        return []
    return tiers


def drop_added_tiers(namespace: str) -> None:
    """Forget the tiers added to ``namespace`` (``raykv stop``)."""
    _drop(_tiers_key(namespace), "the tiers added to raykv")


def mark_stopping(namespace: str, until: float) -> None:
    """Note that a failed first start stops ``namespace``'s raykv, until ``until`` at the
    latest (``time.time()``): another start waits for it, then starts raykv again."""
    _put(_stopping_key(namespace), float(until), "that a failed start stops raykv")


def stopping_until(namespace: str) -> float | None:
    """Until when a failed first start may still be stopping ``namespace``'s raykv
    (``time.time()``); None when none is."""
    until = _get(_stopping_key(namespace), "whether a failed start stops raykv")
    return until if isinstance(until, float) else None


def clear_stopping(namespace: str) -> None:
    """The failed first start has stopped ``namespace``'s raykv."""
    _drop(_stopping_key(namespace), "that a failed start stops raykv")
