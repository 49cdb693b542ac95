"""Shared fixtures: a real local Ray that the modules asking for it share, clusters per module."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray

REPO_ROOT = Path(__file__).resolve().parents[1]
# The tests' shared helpers (tests/waiting.py, tests/clusters.py) import as
# ``tests.<module>`` also where pytest was not started from the repository root.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.clusters import RayCluster, ray_cluster, start_local_ray  # noqa: E402

# Keep Ray's own chatter and usage reporting out of test runs.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the long soak tests")
    parser.addoption(
        "--launch", action="store_true", help="run `ray up` of the on-prem YAML against localhost over SSH (root)"
    )


#: pytest's exit status, kept for ``pytest_unconfigure``.
_session_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _session_status
    _session_status = int(exitstatus)
    # Tests end their Ray without `raykv stop`: the node agents' /dev/shm views (and any
    # vLLM offload segment) that no process maps any more are this run's leftovers.
    try:
        from raykv.services.shm_cleanup import remove_stale_segments

        remove_stale_segments()
    except Exception as e:  # cleanup only: never change the run's result
        print(f"raykv test cleanup of /dev/shm failed: {e!r}", file=sys.stderr)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process with pytest's status once everything is reported,
    without running C++ static destructors.

    Why (Ray 2.60, upstream): every ``ray.init()`` in a process adds one
    OpenTelemetry metric reader thread to Ray's process-wide metric recorder, and
    ``ray.shutdown()`` never stops it (``tests/test_ray_exit.py`` pins the leak).
    Each leaked thread keeps exporting to its dead session's agent and logs the
    failure. A run of ~45 module-scoped Ray sessions holds ~45 of them; when one
    logs while ``exit()`` destroys the C++ statics, the process dies with SIGSEGV
    in ``spdlog::details::registry::initialize_logger`` (core dump of a full
    ``make test``: ``OpenTelemetryMetricExporter::Export -> RayLog::~RayLog``),
    after every test passed. Nothing a test asserts runs after this point."""
    if _session_status is None:
        return
    if ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_status)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    # The modules on the shared local Ray (``ray_local``) run last, one after another; the
    # others run first, in their order, as they would alone (none finds that Ray running).
    on_shared = {getattr(item, "module", None) for item in items if "ray_local" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: getattr(item, "module", None) in on_shared)
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "soak" in item.keywords and not config.getoption("--soak"):
            item.add_marker(pytest.mark.skip(reason="opt-in: --soak"))
        if "launch" in item.keywords and not config.getoption("--launch"):
            item.add_marker(pytest.mark.skip(reason="opt-in: --launch"))


#: The GCS address of the local Ray that ``ray_local`` modules share, once started.
_shared_ray_address: str | None = None


def _on_shared_ray() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared_ray_address


def _kill_named_actors_left() -> None:
    """Kill the named actors a module left running, in every namespace, and forget the
    raykv services this process attached to: the next module on the shared Ray starts
    from none (raykv's actors are named and detached)."""
    from raykv.core.named import find_actor
    from raykv.services.cluster import attached_services

    for services in attached_services():
        services.retire()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        actor = find_actor(entry["name"], entry["namespace"])
        if actor is not None:  # (not gone meanwhile)
            ray.kill(actor)


@pytest.fixture(scope="module")
def ray_local():
    """A single-node local Ray (4 CPUs, 512 MiB of object store) for the module.

    The modules that ask for it share one Ray, one after another (``pytest_collection_
    modifyitems`` runs them last, together): a Ray start costs ~5 s on a 2-core machine,
    and each leaves a thread behind (``pytest_unconfigure``). A module that shut it down,
    or connected to another Ray, gets a fresh one. What a module leaves running (named
    actors, in any namespace) is killed at its end."""
    global _shared_ray_address
    if not _on_shared_ray():
        start_local_ray(num_cpus=4, object_store_memory=512 * 1024 * 1024)
        _shared_ray_address = ray.get_runtime_context().gcs_address
    yield
    if _on_shared_ray():
        _kill_named_actors_left()


@pytest.fixture(scope="module")
def raykv_services(ray_local):
    """raykv started on the module's local Ray (2 directory shards)."""
    import raykv

    services = raykv.start({"namespace": "raykv-test", "directory_shards": 2})
    yield services
    services.shutdown()


@pytest.fixture(scope="module")
def make_ray_cluster() -> Iterator[Callable[..., RayCluster]]:
    """``make_ray_cluster(head=..., workers=[...], init=...)``: a multi-node
    ``ray.cluster_utils.Cluster`` this driver is connected to, torn down at the
    end of the module (``tests/clusters.py``'s ``ray_cluster``). Each module passes
    its own node count, resources and object-store sizes."""
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(ray_cluster(**kw))


@pytest.fixture(scope="session")
def vllm_env() -> None:
    """Env that vLLM (and its spawned engine/worker processes) need; skips without vLLM,
    and where this vLLM has no platform to run an engine on (the 0.33 API-level run of
    ``make test-vllm-matrix``: the CUDA wheel's modules on a host without CUDA)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip(f"vLLM {_vllm_version()} has no platform on this host: no engine can start")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Spawned processes must import raykv (the spec is loaded by module path)
    # even when it is not pip-installed.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, paths)])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from raykv.demo.tiny_model import MODEL_NAME, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function that returns a TCP port free on 127.0.0.1 right now."""
    return _free_port


def _system_binary(names: tuple[str, ...], override_env: str, require_env: str, hint: str) -> str:
    path = os.environ.get(override_env) or next(filter(None, map(shutil.which, names)), None)
    if not path:
        msg = f"no {names[0]} ({hint})"
        if os.environ.get(require_env):
            pytest.fail(msg)  # CI installs it: its absence is a failure, not a skip
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def system_binary() -> Callable[..., str]:
    """``system_binary(names, override_env, require_env, hint)``: the path of an
    installed program (``override_env`` first, then ``names`` on PATH); the test
    skips without it, or fails when ``require_env`` is set."""
    return _system_binary


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        import vllm

        return getattr(vllm, "__version__", "?")
