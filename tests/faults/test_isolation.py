"""Isolation: tenants never share KV, files are owner-only, Ray's token auth
is never turned off, and no path component comes from user input."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from raykv.config.options import RaykvConfig
from raykv.core.contract import LookupResult
from raykv.core.factory import TierFactory
from raykv.core.identity import scoped_keys
from raykv.core.keys import prefix_keys
from raykv.core.validate import ConfigError
from raykv.engine.primary import PrimaryRegion
from raykv.engine.tier_driver import TierDriver
from tiers.fs import format as fmt
from tiers.fs.storage import LocalStorage

BLOCK = 32 * 1024
REPO = Path(__file__).resolve().parents[2]
TOKENS = list(range(900_000, 900_080))  # the same prompt for every tenant


@pytest.mark.parametrize("tier_type", ["object_store", "fs"])
def test_tenant_salt_isolates_prefixes(raykv_services, tmp_path, tier_type):
    cfg = {"type": tier_type, **({"root": str(tmp_path / "kv"), "fsync": False} if tier_type == "fs" else {})}
    a_keys = prefix_keys(TOKENS, 10, salt=f"tenant-a-{tier_type}")
    b_keys = prefix_keys(TOKENS, 10, salt=f"tenant-b-{tier_type}")
    assert not set(a_keys) & set(b_keys)
    with PrimaryRegion(8, BLOCK) as a_reg, PrimaryRegion(8, BLOCK) as b_reg:
        a_reg.array[:] = 0xA
        a = TierFactory.create_tier(cfg, a_reg.view, services=raykv_services)
        b = TierFactory.create_tier(cfg, b_reg.view, services=raykv_services)
        assert TierDriver(a).store(a_keys, list(range(8))).success
        raykv_services.lookup_cache.invalidate(scoped_keys(a_keys + b_keys))
        # tenant B, same prompt: nothing in the cluster (directory or tier) matches
        assert b.lookup_blocking(b_keys) == [LookupResult.MISS] * 8
        assert raykv_services.directory.prefix_lookup(scoped_keys(b_keys)).num_keys == 0
        assert raykv_services.directory.prefix_lookup(scoped_keys(a_keys)).num_keys == 8
        res = TierDriver(b).load(b_keys, list(range(8)))
        assert not res.success and not res.successful_keys and not b_reg.array.any()
        # tenant A again (same salt) hits: the test can tell a hit from a miss
        assert b.lookup_blocking(a_keys) == [LookupResult.HIT] * 8
        a.shutdown()
        b.shutdown()


def _modes(root: Path) -> tuple[set[int], set[int]]:
    dirs, files = {stat.S_IMODE(root.stat().st_mode)}, set()
    for dirpath, dnames, fnames in os.walk(root):
        dirs |= {stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode) for d in dnames}
        files |= {stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) for f in fnames}
    return dirs, files


def test_fs_files_owner_only_even_with_umask_0(raykv_services, tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "kv"
        keys = prefix_keys(list(range(80)), 10, salt="modes")
        with PrimaryRegion(8, BLOCK) as reg:
            t = TierFactory.create_tier(
                {"type": "fs", "root": str(root), "fsync": False}, reg.view, services=raykv_services
            )
            assert TierDriver(t).store(keys, list(range(8))).success
            t.shutdown()
        # a URI root goes through pyarrow.fs: same modes
        uri_root = tmp_path / "kv-uri"
        LocalStorage(str(tmp_path / "direct")).ensure_root()
        from tiers.fs.storage import ArrowStorage

        s = ArrowStorage(f"file://{uri_root}")
        s.ensure_root()
        s.store(keys[0], memoryview(np.zeros(BLOCK, np.uint8)), fsync=False)
    finally:
        os.umask(old)
    for r in (root, uri_root, tmp_path / "direct"):
        dirs, files = _modes(r)
        assert dirs == {0o700}, (r, [oct(m) for m in dirs])
        assert files <= {0o600}, (r, [oct(m) for m in files])
    assert _modes(root)[1] == {0o600}


# -- Ray's token auth -------------------------------------------------------------------
_AUTH_OFF = re.compile(
    r"""RAY_AUTH_MODE["']?\s*[\]:=,)]|auth_mode["']?\s*[:=]|RAY_AUTH_MODE=|["']?disabled["']?\s*#\s*auth|--disable-auth""",
    re.IGNORECASE,
)


# Turning token auth on is allowed (the cluster YAMLs' workers: RAY_AUTH_MODE=token where the node
# has a token); any other value, or one the line does not spell out, is an offender.
_AUTH_ON = re.compile(r"""(RAY_AUTH_MODE|auth_mode)["']?\]?\s*[:=,]?\s*["']?token\b""", re.IGNORECASE)


def _auth_offenders(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _AUTH_OFF.search(_AUTH_ON.sub("", line))]


def test_raykv_never_turns_off_ray_token_auth():
    # the pattern does catch the ways of turning auth off
    for bad in (
        'os.environ["RAY_AUTH_MODE"] = "disabled"',
        "os.environ.setdefault('RAY_AUTH_MODE', 'disabled')",
        "RAY_AUTH_MODE=disabled ray start --head",
        "env: {RAY_AUTH_MODE: disabled}",
        "ray.init(_system_config={'auth_mode': 'disabled'})",
        "RAY_AUTH_MODE=token RAY_AUTH_MODE=disabled ray start --head",
        "RAY_AUTH_MODE=$MODE ray start --head",
        "RAY_AUTH_MODE=tokenless ray start --head",
    ):
        assert _auth_offenders(bad), bad
    # ...and lets turning it on pass
    for good in (
        "env $(test -s ~/.ray/auth_token && echo RAY_AUTH_MODE=token) ray start --address=$RAY_HEAD_IP:6379",
        'os.environ["RAY_AUTH_MODE"] = "token"',
        "env: {RAY_AUTH_MODE: token}",
    ):
        assert not _auth_offenders(good), good
    files = [
        p
        for d in ("raykv", "tiers", "cluster_configs", ".ci", "notebooks")
        for p in (REPO / d).rglob("*")
        if p.is_file() and p.suffix in {".py", ".yaml", ".yml", ".sh", ".json", ".ipynb", ".toml", ""}
    ] + [p for p in (REPO / "Makefile", REPO / "pyproject.toml") if p.exists()]
    assert len(files) > 20
    found = {str(p.relative_to(REPO)): o for p in files if (o := _auth_offenders(p.read_text(errors="replace")))}
    assert not found, f"raykv must not touch Ray's token auth: {found}"


# -- no path component from user input ------------------------------------------------------
def test_no_path_component_from_user_input(raykv_services, tmp_path):
    # (a namespace only names Ray actors, never a path; still no '/' or NUL gets in)
    for ns in ("../x", "a/b", "", "x\x00y", "~root", "a b"):
        with pytest.raises(ConfigError, match="namespace"):
            RaykvConfig.from_dict({"namespace": ns})
        with pytest.raises(ConfigError, match="namespace"):
            TierFactory.parse({"type": "fs", "root": "/tmp/x", "namespace": ns})
    for root in ("relative/kv", "kv", "", "/tmp/a\x00b", "s3://"):
        with pytest.raises(ConfigError, match="root"):
            TierFactory.parse({"type": "fs", "root": root})
    # keys are arbitrary bytes: their file paths are their hex (or a hash), always under the root
    evil = [
        b"../../../../etc/passwd\x00\x00\x00\x00",
        b"/abs/path" + bytes(4),
        b"..\\..\\x" + bytes(4),
        bytes(200) + b"/..",
    ]
    for k in evil:
        rel = fmt.rel_path(k)
        assert ".." not in rel.split("/") and not rel.startswith("/") and set(rel) <= set("0123456789abcdefh/.kv")
    root = tmp_path / "kv"
    with PrimaryRegion(4, BLOCK) as reg:
        reg.array[:] = 1
        t = TierFactory.create_tier(
            {"type": "fs", "root": str(root), "fsync": False}, reg.view, services=raykv_services
        )
        assert TierDriver(t).store(evil, [0, 1, 2, 3]).success
        t.shutdown()
    inside = {os.path.realpath(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}
    assert len(inside) == 4 and all(p.startswith(str(root.resolve()) + os.sep) for p in inside)
    assert {p.name for p in tmp_path.iterdir()} == {"kv"}  # nothing written beside the root
    # a root spelled with '..' is normalized to one canonical root (one actor name, one holder)
    from tiers.fs.storage import canonical_root

    assert canonical_root(f"{tmp_path}/x/../kv/") == str(root)
