"""The control actor's run-time state, kept in the GCS's key-value store: its policy
rules, and the tiers later ``raykv start`` calls added.

Ray restarts a crashed control actor in place, with only its constructor's
config: the rules an operator added or removed at run time, and the tiers a later
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


def save_rules(namespace: str, checkpoint: RulesCheckpoint) -> None:
    """Write ``checkpoint`` for ``namespace`` (a GCS error is logged: the engines'
    give-back, ``restore_rules``, is then what a restart has)."""
    try:
        internal_kv._internal_kv_put(_key(namespace), pickle.dumps(checkpoint), True, namespace=KV_NAMESPACE)
    except Exception as e:  # the GCS busy or restarting
        logger.warning("could not keep raykv's policy rules v%d in the GCS: %r", checkpoint.version, e)


def load_rules(namespace: str) -> RulesCheckpoint | None:
    """The rules last written for ``namespace``; None when there are none or they
    cannot be read (written by another raykv release, or the GCS unreachable)."""
    try:
        raw = internal_kv._internal_kv_get(_key(namespace), namespace=KV_NAMESPACE)
        if raw is None:
            return None
        checkpoint = pickle.loads(raw)
    except Exception as e:
        logger.warning("could not read raykv's policy rules from the GCS: %r", e)
        return None
    if not isinstance(checkpoint, RulesCheckpoint):
        logger.warning("ignoring raykv's policy rules in the GCS: not a RulesCheckpoint")
        return None
    return checkpoint


def drop_rules(namespace: str) -> None:
    """Forget ``namespace``'s rules (``raykv stop``: the next start begins from its config)."""
    try:
        internal_kv._internal_kv_del(_key(namespace), namespace=KV_NAMESPACE)
    except Exception as e:
        logger.warning("could not remove raykv's policy rules from the GCS: %r", e)


def save_added_tiers(namespace: str, tiers: list[dict[str, object]]) -> None:
    """Write the tier configs later starts added to ``namespace``'s first config (a GCS
    error is logged: a restart after a crash then has the first start's tiers only)."""
    try:
        internal_kv._internal_kv_put(_tiers_key(namespace), pickle.dumps(list(tiers)), True, namespace=KV_NAMESPACE)
    except Exception as e:  # the GCS busy or restarting
        logger.warning("could not keep the tiers added to raykv in the GCS: %r", e)


def load_added_tiers(namespace: str) -> list[dict[str, object]]:
    """The tier configs last written for ``namespace`` (none when there are none or
    they cannot be read)."""
    try:
        raw = internal_kv._internal_kv_get(_tiers_key(namespace), namespace=KV_NAMESPACE)
        tiers = pickle.loads(raw) if raw is not None else []
    except Exception as e:
        logger.warning("could not read the tiers added to raykv from the GCS: %r", e)
        return []
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        logger.warning("ignoring the tiers added to raykv in the GCS: not a list of tier configs")
        return []
    return tiers


def drop_added_tiers(namespace: str) -> None:
    """Forget the tiers added to ``namespace`` (``raykv stop``)."""
    try:
        internal_kv._internal_kv_del(_tiers_key(namespace), namespace=KV_NAMESPACE)
    except Exception as e:
        logger.warning("could not remove the tiers added to raykv from the GCS: %r", e)
