"""CPU seconds used by the processes of this host, grouped by role (benchmark profiles).

A Ray worker's role is its actor class (its process title, ``ray::Class.method``);
vLLM's engine-core and worker processes are ``vLLM EngineCore`` / ``vLLM Worker...``
(vLLM sets their titles ``VLLM::<name>``); Ray's own daemons keep their names
(``raylet``, ``gcs_server``); the rest is ``other``. ``cpu_delta`` between two
``cpu_by_role`` snapshots says which processes a benchmark phase kept busy.
"""

from __future__ import annotations

import psutil


def process_role(proc: psutil.Process) -> str:
    """A process's role: its Ray actor class, ``vLLM <name>``, a Ray daemon, or ``other``."""
    try:
        cmd = proc.cmdline()
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "other"
    title = cmd[0] if cmd else ""
    if title.startswith("ray::"):
        return title.removeprefix("ray::").split(".", 1)[0].split(" ", 1)[0] or "ray worker (idle)"
    if title.startswith("VLLM::"):
        return "vLLM " + (title.removeprefix("VLLM::").split(" ", 1)[0] or "process")
    if name in ("raylet", "gcs_server"):
        return name
    return "other"


def cpu_by_role() -> dict[int, tuple[str, float]]:
    """Per live process: (role, user + system CPU seconds so far)."""
    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter():
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[proc.pid] = (process_role(proc), t.user + t.system)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots, busiest first (processes that
    ended in between are not counted; new ones count from zero)."""
    totals: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent = seconds - before.get(pid, (role, 0.0))[1]
        if spent > 0:
            totals[role] = totals.get(role, 0.0) + spent
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


#: raykv's process roles, by the roles ``cpu_by_role`` names. Engines count whole
#: (vLLM's compute too): raykv's own share of their scheduler thread is
#: ``raykv_engine_tier_seconds`` (``raykv.metrics.step_cost``).
RAYKV_ROLES = {
    "ObjectStoreActor": "holder actors",
    "FsRootActor": "holder actors",
    "ExampleNodeActor": "holder actors",
    "EngineCacheActor": "holder actors",
    "DirectoryShard": "directory shards",
    "ControlActor": "control",
    "ProxyActor": "Serve HTTP proxy",
    "EngineReplica": "engines",
}


def raykv_role(role: str) -> str | None:
    """The raykv process role of a ``cpu_by_role`` role (None: not one of raykv's)."""
    if role.startswith("ServeReplica"):
        # Serve LLM's engine replicas (LLMServer); the ingress replica runs the
        # request router (Serve routes from the handle's caller).
        return "engines" if "LLMServer" in role else "router (Serve ingress)"
    if role.startswith("vLLM "):  # the engine processes Serve LLM's replicas start
        return "engines"
    return RAYKV_ROLES.get(role)


def cpu_per_request(spent: dict[str, float], requests: int) -> dict[str, float]:
    """CPU seconds per served request of each raykv process role, from a
    ``cpu_delta`` over a trace that served ``requests`` requests, busiest first."""
    if requests <= 0:
        raise ValueError(f"requests must be > 0, got {requests}")
    out: dict[str, float] = {}
    for role, seconds in spent.items():
        group = raykv_role(role)
        if group is not None:
            out[group] = out.get(group, 0.0) + seconds / requests
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
