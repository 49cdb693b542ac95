"""``raykv.services.cluster.ensure_ray``: joining Ray from a process that is someone else's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ray

#: A process with its own SIGTERM handler (as vLLM's engine core has) joins Ray, then gets SIGTERM.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    handled = []
    signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))
    from raykv.services.cluster import ensure_ray
    ensure_ray(sys.argv[1], guest=sys.argv[2] == "guest")
    print("joined", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    print("handled", handled, flush=True)
    """
)


def _run(address: str, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, address, mode], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_guest_process_keeps_its_sigterm_handler_and_prints_no_stack(ray_local) -> None:
    """A vLLM engine joins Ray through its raykv tiers (``guest=True``): its own SIGTERM
    handler still runs, and Ray's failure handler prints no C++ stack on SIGTERM."""
    address = ray.get_runtime_context().gcs_address
    guest = _run(address, "guest")
    assert "joined" in guest.stdout, guest.stderr
    assert "handled [15]" in guest.stdout, (guest.stdout, guest.stderr)
    assert "SIGTERM received" not in guest.stderr, guest.stderr
    # What a plain driver's ray.init does (Ray 2.60), which guest=True undoes: Ray's
    # handler exits the process, after abseil's prints a stack.
    host = _run(address, "driver")
    assert "joined" in host.stdout, host.stderr
    assert "handled" not in host.stdout and "SIGTERM received" in host.stderr, (host.stdout, host.stderr)
