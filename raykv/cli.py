"""The ``raykv`` command: start, status, stop, demo, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from raykv.config import ConfigError
from raykv.errors import RaykvError


def _load_config(path: str | None, namespace: str | None) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    if path:
        with open(path) as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            raw = json.loads(text)
    if namespace:
        raw["namespace"] = namespace
    return raw


def cmd_start(args: argparse.Namespace) -> int:
    import raykv

    services = raykv.start(_load_config(args.config, args.namespace), address=args.address)
    print(
        f"raykv running in Ray namespace {services.namespace!r} "
        f"({services.directory.num_shards} directory shards)"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import raykv
    from raykv.status import collect_status, format_status

    services = raykv.attach(args.namespace or "raykv", address=args.address)
    status = collect_status(services)
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    import raykv

    raykv.attach(args.namespace or "raykv", address=args.address).shutdown()
    print("raykv stopped")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from raykv.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raykv", description="A cluster-wide KV cache for LLM serving on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--address", help="Ray cluster address (default: auto)")
        sp.add_argument("--namespace", help="raykv's Ray namespace (default: raykv)")

    sp = sub.add_parser("start", help="start raykv's services on a running Ray cluster")
    common(sp)
    sp.add_argument("--config", help="raykv config file (YAML or JSON)")
    sp.set_defaults(func=cmd_start)

    sp = sub.add_parser("status", help="services, tiers per node, occupancy, directory size")
    common(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("stop", help="stop raykv's actors (their cached blocks go too)")
    common(sp)
    sp.set_defaults(func=cmd_stop)

    sp = sub.add_parser("demo", help="run the demo on an embedded local Ray")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--model", help="model path (default: a tiny local model)")
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, RaykvError) as e:
        print(f"raykv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
