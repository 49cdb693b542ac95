"""This process's Ray token authentication, matched to the cluster it connects to.

Ray 2.60 turns token authentication on for a process connecting to an explicit address
only when ``RAY_AUTH_MODE=token`` says so; a cluster that ``ray start --head`` started
with a token in ``~/.ray/auth_token`` then refuses it, after 20 s of retries. Turning it
on whenever a token file exists is wrong the other way: a process with token auth on
connects to a cluster without it, but then requires a token on the calls the cluster
makes to it, which carry none. Everything it owns breaks: an actor it creates is
destroyed at once ("Missing authorization header"; the owner's reference looks gone).
A local token file is common (Ray 2.60's local ``ray.init()`` writes one), so the
cluster is asked which it uses.
"""

from __future__ import annotations

import logging
import os

AUTH_MODE_ENV = "RAY_AUTH_MODE"
#: The probe's limit: a GCS answers it in milliseconds (one gRPC call, no retries).
PROBE_TIMEOUT_S = 3.0


def match_cluster_token_auth(address: str) -> None:
    """Turn this process's token authentication on when the cluster at ``host:port``
    (``address``) requires a token, unless ``RAY_AUTH_MODE`` already says which.
    Call it before ``ray.init``; a cluster that cannot be asked is taken to use one
    when this machine has a token, as Ray does for ``address="auto"``."""
    if os.environ.get(AUTH_MODE_ENV) is not None:
        return
    if cluster_requires_token(address) is False:
        return
    try:
        from ray._private.authentication import authentication_token_setup as auth
    except ImportError:  # a Ray release without token auth
        return
    # Ray has no public API for this (2.60): it is the call ``ray.init`` makes for ``auto``.
    quiet = logging.getLogger(auth.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "token authentication is enabled" line, at every command
    try:
        auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


def cluster_requires_token(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the Ray cluster whose GCS is at ``host:port`` refuses calls without a token:
    one call that needs no arguments (``GetClusterId``), sent without one. None when it
    cannot tell (no answer in ``timeout_s``, TLS, a Ray without these modules)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    # Ray 2.60 has no public call that says whether a cluster uses token authentication.
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)  # type: ignore[attr-defined]
        except grpc.RpcError as e:
            return True if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False
