"""Names of raykv's Ray actors (what the dashboard's Actors view shows)."""

from __future__ import annotations

import hashlib

DEFAULT_NAMESPACE = "raykv"
CONTROL_ACTOR = "raykv-control"


def directory_shard(index: int) -> str:
    return f"raykv-directory-{index}"


#: Names of the node agents start with this (``raykv stop`` finds them by it).
DIRECTORY_AGENT_PREFIX = "raykv-directory-agent-"


def directory_agent(node_id: str) -> str:
    """A node's directory agent (``raykv.directory.agent``)."""
    return DIRECTORY_AGENT_PREFIX + node_id


def object_store_actor(node_id: str) -> str:
    return f"raykv-object-store-{node_id}"


def fs_actor(root: str) -> str:
    return f"raykv-fs-{root_digest(root)}"


def root_digest(root: str) -> str:
    """Short stable id of a shared-storage root (safe in names and paths)."""
    return hashlib.sha256(root.encode()).hexdigest()[:16]


#: The Ray node of a Serve replica, noted by raykv's vLLM plugin for the engine process it
#: spawns (``raykv.core.node.process_node_id``).
NODE_ENV = "RAYKV_ENGINE_NODE"
#: The Ray actor id (hex) of the process that created an engine (its Serve replica),
#: noted by raykv's vLLM plugin before vLLM spawns the engine.
OWNER_ENV = "RAYKV_ENGINE_OWNER"
