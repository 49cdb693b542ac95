"""raykv's vLLM general plugin (entry point ``vllm.general_plugins: raykv``).

vLLM runs general plugins in every process it starts, first in the one that
creates the engine (a Ray Serve replica, for Ray Serve LLM), before it spawns
the engine process. There ``register`` notes the Ray actor running vLLM in
``RAYKV_ENGINE_OWNER``, which the engine process inherits: raykv's engine-cache
holder then names the replica it belongs to, so a request router can send a
request to the replica whose engine holds its prefix. It imports nothing heavy
and may run many times.
"""

from __future__ import annotations

import os

#: The Ray actor id (hex) of the process that created the engine.
OWNER_ENV = "RAYKV_ENGINE_OWNER"


def register() -> None:
    """Note this process's Ray actor (when it is one) for the engine it is about to spawn."""
    if os.environ.get(OWNER_ENV):
        return
    try:
        import ray

        if not ray.is_initialized():
            return
        actor_id = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - a plugin must never stop vLLM from starting
        return
    if actor_id:
        os.environ[OWNER_ENV] = actor_id
