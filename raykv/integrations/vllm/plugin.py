"""raykv's vLLM general plugin (entry point ``vllm.general_plugins: raykv``).

vLLM runs general plugins in every process it starts, first in the one that
creates the engine (a Ray Serve replica, for Ray Serve LLM), before it spawns
the engine process. There ``register`` notes the Ray actor running vLLM in
``RAYKV_ENGINE_OWNER``, which the engine process inherits: raykv's engine-cache
holder then names the replica it belongs to, so a request router can send a
request to the replica whose engine holds its prefix.

It also notes the replica's Ray node in ``RAYKV_ENGINE_NODE``. The engine process
is no Ray worker: raykv's tiers join Ray from it as a driver, and where several
raylets share a host (a simulated ``ray.cluster_utils.Cluster``) Ray connects a
driver to the head's, whose node id the runtime context then reports. raykv's
engine side takes its node from ``raykv.core.node.process_node_id``, which prefers
the noted node (on a multi-host cluster the two agree). It imports nothing heavy
and may run many times.

In every process it also requests the AMX tile state (``raykv.integrations.vllm.amx``):
vLLM's CPU attention kernel uses AMX without asking, which kills an engine whose
first forward pass is a fully cached prefix's last token.
"""

from __future__ import annotations

import os
import sys

from raykv.core.naming import NODE_ENV, OWNER_ENV
from raykv.integrations.vllm.amx import request_amx_permission


def register() -> None:
    """Note this process's Ray actor (when it is one) and, in a Ray worker, its
    node, for the engine it is about to spawn; request AMX tile state."""
    request_amx_permission()
    ray = sys.modules.get("ray")
    if ray is None:  # not even imported: this process has not joined Ray
        return
    try:
        if not ray.is_initialized():
            return
        context = ray.get_runtime_context()
        actor_id = context.get_actor_id()
        # A Ray worker's node is its raylet's; a driver's (such as the engine
        # process itself, once raykv joined Ray from it) may be the head's.
        node_id = context.get_node_id() if context.worker.mode == ray.WORKER_MODE else None
    except Exception:  # noqa: BLE001 - a plugin must never stop vLLM from starting
        return
    if actor_id and not os.environ.get(OWNER_ENV):
        os.environ[OWNER_ENV] = actor_id
    if node_id:
        os.environ[NODE_ENV] = node_id
