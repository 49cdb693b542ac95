"""The ``raykv`` command: start, status, invalidate, unpin, warm, stop, demo, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence

from raykv.config.file import load_config_file
from raykv.core import signals
from raykv.core.errors import RaykvError, root_cause
from raykv.core.logs import configure_cli
from raykv.core.units import parse_size
from raykv.core.validate import ArgumentError, ConfigError

#: Set to show the traceback of an unexpected error (raykv's own bug, or Ray's).
DEBUG_ENV = "RAYKV_DEBUG"


def _load_config(path: str | None, namespace: str | None) -> dict[str, object]:
    raw: dict[str, object] = load_config_file(path) if path is not None else {}
    if namespace is not None:
        raw["namespace"] = namespace
    return raw


def cmd_start(args: argparse.Namespace) -> int:
    import raykv

    services = raykv.start(_load_config(args.config, args.namespace), address=args.address)
    print(f"raykv running in Ray namespace {services.namespace!r} ({services.directory.num_shards} directory shards)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import raykv
    from raykv.ops.status import collect_status, format_status

    services = raykv.attach(args.namespace or "raykv", address=args.address)
    status = collect_status(services, metrics=not args.no_metrics)
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    import raykv
    from raykv.services.shm_cleanup import clean_cluster, summary

    stopped = raykv.stop(args.namespace or "raykv", address=args.address)
    if stopped.was_running:
        print("raykv stopped")
    else:  # like `ray stop`: nothing running is not an error (the message catches a mistyped namespace)
        left = f"; killed {len(stopped.leftovers)} raykv actors left there" if stopped.leftovers else ""
        print(f"raykv was not running in Ray namespace {stopped.namespace!r}{left}")
    # vLLM's CPU-offload segments of engines that died before unlinking them
    # outlive `ray down`: remove those no process uses, on every node.
    print(summary(clean_cluster()))
    return 0


def _print_per_holder(per_holder: dict[str, int], errors: dict[str, str]) -> None:
    """One line per holder reached (its count), then one per holder not reached (why)."""
    for holder, n in sorted(per_holder.items()):
        print(f"  {holder}: {n}")
    for holder, err in sorted(errors.items()):
        print(f"  {holder}: not reached ({err})")


def cmd_invalidate(args: argparse.Namespace) -> int:
    import raykv

    services = raykv.attach(args.namespace or "raykv", address=args.address)
    out = services.invalidate(args.model, args.revision)
    if args.json:
        print(json.dumps(out.report(), indent=2, default=str))
        return 0
    what = f"{args.model}" + (f"@{args.revision}" if args.revision else " (every revision)")
    if not out.identities:
        print(f"raykv: no KV identity of {what} is known; nothing dropped")
        return 0
    print(f"{what}: {len(out.identities)} KV identities, {out.blocks_dropped} blocks dropped")
    _print_per_holder(out.per_holder, out.errors)
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    import raykv

    if not (args.tenant or args.key or args.all):
        raise ConfigError(
            "raykv unpin", "name what to unpin: --tenant NAME (repeatable), --key HEX (repeatable) or --all"
        )
    keys = []
    for k in args.key or ():
        try:
            keys.append(bytes.fromhex(k))
        except ValueError:
            raise ConfigError("--key", f"must be a scoped tier key in hex, got {k!r}") from None
    services = raykv.attach(args.namespace or "raykv", address=args.address)
    out = services.unpin(tenants=args.tenant or (), keys=keys, everything=args.all)
    if args.json:
        print(json.dumps(out.report(), indent=2, default=str))
        return 0
    named = [f"tenant {t!r}" for t in args.tenant or ()] + ([f"{len(keys)} keys"] if keys else [])
    what = "every pin" if args.all else ", ".join(named)
    print(f"unpinned {out.blocks_unpinned} blocks ({what}); they now age under LRU")
    _print_per_holder(out.per_holder, out.errors)
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    import raykv
    from raykv.ops.prompt_file import read_prompts
    from raykv.ops.warm import app_model, check_ttl, warm

    ttl = check_ttl(args.ttl)
    prompts = read_prompts(args.prompt_file)
    model = app_model(args.url, args.model)  # the app answers before Ray is asked anything
    services = raykv.attach(args.namespace or "raykv", address=args.address)
    out = warm(
        services,
        prompts,
        ttl,
        url=args.url,
        model=model,
        tenant=args.tenant,
        request_timeout_s=args.request_timeout,
        all_nodes=args.all_nodes,
    )
    print(json.dumps(out.report(), indent=2, default=str) if args.json else out.format())
    return 0


def cmd_vllm_config(args: argparse.Namespace) -> int:
    from raykv.integrations.vllm import raykv_kv_transfer_config

    raw = _load_config(args.config, args.namespace)
    if args.model_revision is not None and not args.model_revision.strip():
        raise ArgumentError("--model-revision", "must be a non-empty revision (a date, a commit, a tag)")
    kv = raykv_kv_transfer_config(
        raw,
        cpu_bytes=args.cpu_bytes,
        ray_address=args.ray_address,
        model_revision=args.model_revision,
        weights_fingerprint=args.weights_fingerprint,
    )
    print(json.dumps(kv))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from raykv.demo.run import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark; print its tables, or one JSON object with ``--json``."""
    from raykv import bench
    from raykv.bench.common import to_json

    module = bench.load(args.bench)
    if args.json:  # stdout holds the one JSON object: Ray's driver-side notices go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            result = module.run(args)
        print(to_json(result))
    else:
        print(module.format_result(module.run(args)))
    return 0


def _add_bench_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``raykv bench <name>``: one sub-command per benchmark module present."""
    from raykv import bench

    sp = sub.add_parser("bench", help="benchmarks against baselines of the same run (tables, or --json)")
    names = sp.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(bench.available()) + "}")
    for name in bench.available():
        module = bench.load(name)
        bp = names.add_parser(
            name, help=module.HELP, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        bp.add_argument("--json", action="store_true", help="print one JSON object")
        bp.add_argument("--quick", action="store_true", help="a small, fast configuration (smoke tests)")
        bp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
        module.add_arguments(bp)
        bp.set_defaults(func=cmd_bench)


def _int_at_least(minimum: int, text: str) -> int:
    """``text`` as an int >= ``minimum``, else argparse's error for it."""
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        allowed = {0: "0 or a positive integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def _replica_count(text: str) -> int:
    """The demo's replicas: it shows blocks shared across them, so at least 2."""
    return _int_at_least(2, text)


def _size(text: str) -> int:
    """A positive number of bytes: digits, or a size such as ``8GiB`` (``raykv.core.units.parse_size``)."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


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

    sp = sub.add_parser("status", help="services, tiers per node, occupancy, hit rates, directory size")
    common(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--no-metrics", action="store_true", help="skip the engines' hit rates (no metrics scrape)")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("invalidate", help="drop every cached block of a model (one revision, or all) from every tier")
    common(sp)
    sp.add_argument("--model", required=True, help="the model name or path, as the engines loaded it")
    sp.add_argument("--revision", help="only this revision (default: every revision and weights version)")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_invalidate)

    sp = sub.add_parser(
        "unpin",
        help="drop pins (kv_transfer_params cache_ttl_s) by tenant, by key, or all; the blocks stay, under LRU",
    )
    common(sp)
    sp.add_argument(
        "--tenant", action="append", help="the pins of this tenant (repeatable; '' for requests naming none)"
    )
    sp.add_argument("--key", action="append", help="the pin of this scoped tier key, in hex (repeatable)")
    sp.add_argument("--all", action="store_true", help="every pin")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_unpin)

    sp = sub.add_parser(
        "warm",
        help="compute prompts once on a Serve app (one /v1/completions request each) and pin their "
        "blocks cluster-wide for --ttl seconds; reports the blocks and bytes pinned per tier",
    )
    common(sp)
    sp.add_argument("--url", default="http://127.0.0.1:8000", help="the app's OpenAI-compatible endpoint")
    sp.add_argument("--model", help="the served model id (default: the app's one model, from /v1/models)")
    sp.add_argument(
        "--prompt-file",
        required=True,
        help="one prompt per line: text, a JSON string (text with escapes), or a JSON list of token ids",
    )
    sp.add_argument("--ttl", type=float, required=True, help="seconds to pin the prompts' blocks (at most 7 days)")
    sp.add_argument("--tenant", help="the tenant to pin for (later requests must name the same tenant)")
    sp.add_argument("--request-timeout", type=float, default=600.0, help="seconds each request may take (default 600)")
    sp.add_argument(
        "--all-nodes",
        action="store_true",
        help="then put a copy of the pinned blocks in every node's object store (pinned for --ttl too), "
        "for prefixes every replica will need: each replica's first request loads them from its own node",
    )
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_warm)

    sp = sub.add_parser(
        "stop",
        help="stop raykv's actors (their cached blocks go too) and remove vLLM's leftover "
        "/dev/shm/vllm_offload_* segments that no process uses",
    )
    common(sp)
    sp.set_defaults(func=cmd_stop)

    sp = sub.add_parser(
        "vllm-config", help="print vLLM's --kv-transfer-config JSON for a raykv config (tiers, namespace)"
    )
    sp.add_argument("--config", help="raykv config file (YAML or JSON) listing the tiers")
    sp.add_argument("--namespace", help="raykv's Ray namespace (default: the config's, else raykv)")
    sp.add_argument(
        "--cpu-bytes",
        type=_size,
        default=4 << 30,
        help="CPU primary tier size: bytes or a size like 8GiB (default 4 GiB)",
    )
    sp.add_argument("--ray-address", help="Ray address for the engine process (default: RAY_ADDRESS, else auto)")
    sp.add_argument(
        "--model-revision",
        help="the weights' revision in the engines' KV identity (bump it on every weight update)",
    )
    sp.add_argument(
        "--weights-fingerprint",
        choices=("stat", "content", "none"),
        help="how the KV identity tells weight files apart: stat (default: names, sizes, mtimes), "
        "content (a hash of every byte), none (the model name and --model-revision only)",
    )
    sp.set_defaults(func=cmd_vllm_config)

    sp = sub.add_parser("demo", help="run the demo on an embedded local Ray")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument(
        "--model",
        help="'bench' (default: the local bench model, prefill priced like a real model's; cached), "
        "'bench-long', 'tiny' (the tiny local model: fast, prefill nearly free), or a model directory",
    )
    sp.add_argument("--tiny", action="store_true", help="the tiny local model (same as --model tiny)")
    sp.add_argument(
        "--replicas",
        type=_replica_count,
        default=2,
        help="vLLM replicas, one per simulated node (at least 2; default 2)",
    )
    sp.add_argument(
        "--concurrency",
        type=_non_negative_int,
        default=None,
        help="sessions in flight, each turn sent as soon as the last answered (default: one per replica); "
        "0: one request at a time, waiting for its offloads",
    )
    sp.add_argument("--sessions", type=_positive_int, default=5, help="conversations in the workload (default 5)")
    sp.add_argument("--turns", type=_positive_int, default=4, help="turns per conversation (default 4)")
    sp.set_defaults(func=cmd_demo)

    _add_bench_parser(sub)
    return p


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Bad input: one line on stderr, exit code 2 (as argparse's
    own errors); an unexpected error: one line, exit code 1 (its traceback with
    ``RAYKV_DEBUG=1``). Never a bare traceback. Ctrl-C, SIGTERM and SIGHUP run the
    command's clean-up, then exit with 128 + the signal's number."""
    args = build_parser().parse_args(argv)
    configure_cli()
    try:
        with signals.termination_handled():
            return args.func(args)
    except (ConfigError, RaykvError) as e:
        print(f"raykv: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sig = signals.received()
        if sig is None:
            print("raykv: interrupted", file=sys.stderr)
            return 130
        print(f"raykv: stopped by {signal.Signals(sig).name}", file=sys.stderr)
        return 128 + sig
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            raise
        print(
            f"raykv: error: {_one_line(root_cause(e))} (unexpected; rerun with {DEBUG_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
