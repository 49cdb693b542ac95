"""``raykv bench <name>``: benchmarks that measure raykv against baselines of the same run.

Each benchmark is a module of this package exposing:

- ``HELP``: one line for ``raykv bench --help``;
- ``add_arguments(parser)``: its own flags (``--json``, ``--quick`` and
  ``--no-progress`` are added for every benchmark by the CLI);
- ``run(args) -> dict``: runs it and returns one JSON-able result (with a
  ``targets`` list, see ``raykv.bench.common.target``);
- ``format_result(result) -> str``: the human-readable tables.

A benchmark is listed when its module exists: adding ``raykv/bench/e2e.py``
is all it takes for ``raykv bench e2e`` to appear.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: name -> module implementing it (modules that are not installed are skipped).
BENCHMARKS: dict[str, str] = {
    "dataplane": "raykv.bench.dataplane",
    "directory": "raykv.bench.directory",
    "e2e": "raykv.bench.e2e",  # real vLLM engines; lands with the vLLM adapters
    "fork": "raykv.bench.fork",  # a burst sharing a new prefix: computed once cluster-wide or per replica
    "flood": "raykv.bench.flood",  # prompt caching: a pinned prefix through a flood that cycles every tier
    "overload": "raykv.bench.overload",  # the raykv-routed Serve LLM app at 2x capacity: healthy, slow/dead shard
    "recompute": "raykv.bench.recompute",  # prefill time per token against loading its KV (torch only; CUDA too)
    "routing": "raykv.bench.routing",  # a Ray Serve LLM app under three request routers
    "serve": "raykv.bench.serve",  # a Ray Serve LLM app with and without raykv under streaming load
    "view-reads": "raykv.bench.view_reads",  # engines' reads of the node's directory view, every core busy
}


def available() -> list[str]:
    """Names of the benchmarks whose module is present."""
    out = []
    for name, module in BENCHMARKS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            out.append(name)
    return out


def load(name: str) -> ModuleType:
    """The module of benchmark ``name``."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(available())}")
    return importlib.import_module(BENCHMARKS[name])
