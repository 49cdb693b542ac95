"""Which model a demo or bench runs: ``--model`` / ``--tiny``, a built-in name or a directory.

The built-in models ('bench', 'bench-long', 'tiny': ``raykv.demo.tiny_model``)
are built on first use and cached; anything else must be a Hugging Face model
directory, whose config.json is read (and refused with a clear error) before
any replica starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from raykv.core.validate import ArgumentError
from raykv.demo.replicas import model_config

if TYPE_CHECKING:
    from raykv.demo.tiny_model import ModelConfig

#: ``--model`` names of raykv's own models (built on first use); anything else is a model directory.
BUILT_IN_MODELS = ("bench", "bench-long", "tiny")


def model_name(args: argparse.Namespace, quick_means_tiny: bool = True) -> str:
    """``--model``: 'bench' (the default), 'bench-long', 'tiny' or a model directory;
    ``--tiny`` (and ``--quick`` where ``quick_means_tiny``) means 'tiny'."""
    tiny = getattr(args, "tiny", False)
    name = str(args.model or ("tiny" if tiny or (quick_means_tiny and getattr(args, "quick", False)) else "bench"))
    if tiny and name != "tiny":
        raise ArgumentError(f"--tiny and --model {args.model}", "pick one")
    return name


def _built_in(name: str) -> tuple[Callable[[], str], ModelConfig] | None:
    """Built-in model ``name``'s builder and config; None for a model directory."""
    from raykv.demo import tiny_model as m

    return {
        "bench": (m.build_bench_model, m.BENCH_CONFIG),
        "bench-long": (m.build_bench_long_model, m.BENCH_LONG_CONFIG),
        "tiny": (m.build_tiny_model, m.CONFIG),
    }.get(name)


def resolve_model(args: argparse.Namespace, quick_means_tiny: bool = True) -> tuple[str, str]:
    """(model directory, what to call it) from ``--model`` / ``--tiny`` / ``--quick``."""
    name = model_name(args, quick_means_tiny)
    built_in = _built_in(name)
    if built_in is not None:
        return built_in[0](), name
    model_dir_config(name)  # a clear error before any replica starts
    return name, name


def full_name(model: str, name: str) -> str:
    """How a report names the model: a built-in by its full name (its directory's), else its path."""
    return os.path.basename(model) if name in BUILT_IN_MODELS else model


def model_dir_config(name: str) -> dict[str, object]:
    """The config.json of ``--model`` given as a directory; the error names the built-in models too."""
    try:
        return model_config(name)
    except ArgumentError as e:
        why = str(e).partition(": ")[2]
        raise ArgumentError("--model", f"{why} (or one of {', '.join(BUILT_IN_MODELS)})") from None


def model_positions(args: argparse.Namespace) -> int:
    """The ``--model``'s ``max_position_embeddings`` (its longest prompt), read without building it."""
    from raykv.demo.tiny_model import dimension

    name = model_name(args)
    built_in = _built_in(name)
    if built_in is not None:
        return dimension(built_in[1], "max_position_embeddings")
    positions = model_dir_config(name).get("max_position_embeddings")
    if not isinstance(positions, int) or positions < 1:
        raise ArgumentError("--model", f"{name}: its config.json has no max_position_embeddings")
    return positions
