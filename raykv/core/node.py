"""Which Ray node this process runs on, as raykv records it."""

from __future__ import annotations

import logging
import os
import threading

import ray

from raykv.core.naming import NODE_ENV

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: ``process_node_id`` answers, by (the node Ray connected this process to, the noted node).
_node_ids: dict[tuple[str, str], str] = {}


def process_node_id() -> str:
    """The Ray node (hex id) this process runs on, as raykv records it.

    Ray's runtime context names the raylet the process is connected to. An
    engine process that vLLM spawns under a Ray worker (a Ray Serve LLM
    replica) is no Ray worker: it joins the cluster as a driver, and Ray
    connects a driver to the head's raylet when several raylets share its host
    (a simulated ``ray.cluster_utils.Cluster``). The replica itself runs on the
    right node, and raykv's vLLM plugin notes that node in ``RAYKV_ENGINE_NODE``
    before vLLM spawns the engine (``raykv.integrations.vllm.plugin``), so the
    noted node wins when it is an alive node on the same host as the raylet the
    process is connected to. On a multi-host cluster the two are the same node;
    a noted node that is gone or on another host (an inherited leftover) is
    ignored, with a warning.
    """
    connected = ray.get_runtime_context().get_node_id()
    noted = os.environ.get(NODE_ENV, "")
    if not noted or noted == connected:
        return connected
    key = (connected, noted)
    with _lock:
        known = _node_ids.get(key)
    if known is None:
        known = _resolve_noted_node(connected, noted, NODE_ENV)
        with _lock:
            _node_ids[key] = known
    return known


def _resolve_noted_node(connected: str, noted: str, env: str) -> str:
    """``noted`` when it is an alive node on ``connected``'s host, else ``connected``."""
    try:
        nodes = {n["NodeID"]: n for n in ray.nodes()}
    except Exception as e:  # noqa: BLE001 - the process's own raylet is a safe answer
        logger.warning("raykv: cannot read the cluster's nodes (%r); using node %s", e, connected)
        return connected
    mine, theirs = nodes.get(connected), nodes.get(noted)
    if theirs is None or not theirs.get("Alive"):
        logger.warning("raykv: %s=%s is no alive node of this cluster; using node %s", env, noted, connected)
        return connected
    if mine is None or mine.get("NodeManagerAddress") != theirs.get("NodeManagerAddress"):
        logger.warning(
            "raykv: %s=%s is a node of another host (%s); using node %s",
            env,
            noted,
            theirs.get("NodeManagerAddress"),
            connected,
        )
        return connected
    logger.info("raykv: this process is on node %s (%s; Ray connected it to node %s)", noted, env, connected)
    return noted


def ray_session() -> str | None:
    """The Ray session this process is connected to (its GCS address); None when not connected.

    raykv's background threads (policy long poll, fs control, KV-event bridge)
    note it when they start and stop once it changes: a thread still calling
    into Ray after ``ray.shutdown()`` (and a later ``ray.init``) can be inside a
    Ray call when the interpreter exits, which crashes it (ray-project/ray#47864:
    ``check_signals`` taking the GIL during finalization).
    """
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().gcs_address
