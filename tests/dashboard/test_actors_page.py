"""The Ray dashboard's Actors page, in a real headless Chromium, shows raykv's actors and their reprs.

Ray runs here with its dashboard on 127.0.0.1 and token authentication on
(Ray's default): the test types the cluster's token (what `ray get-auth-token`
prints) into the dashboard's dialog like a user, then reads the Actors table.
A screenshot is kept under artifacts/dashboard/ (ignored by git).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import ray

import raykv
from raykv import naming

REPO = Path(__file__).resolve().parents[2]
SHOT = REPO / "artifacts" / "dashboard" / "actors.png"
NS = "raykv-dashboard-test"
# Flags that work in containers without a display, a sandbox or network.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


def _chromium() -> str:
    path = os.environ.get("RAYKV_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        msg = "no chromium (Debian: apt-get install -y chromium)"
        if os.environ.get("RAYKV_REQUIRE_BROWSER"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """A local Ray with its dashboard on 127.0.0.1 and raykv with an object_store and an fs tier."""
    if ray.is_initialized():
        ray.shutdown()
    ctx = ray.init(address="local", num_cpus=1, object_store_memory=128 << 20, include_dashboard=True,
                   dashboard_host="127.0.0.1", dashboard_port=_free_port(), log_to_driver=False)
    root = str(tmp_path_factory.mktemp("fs-root"))
    services = raykv.start({
        "namespace": NS, "directory_shards": 2,
        "tiers": [{"type": "object_store", "capacity_bytes": 8 << 20}, {"type": "fs", "root": root, "capacity_bytes": 0}],
    })
    yield f"http://{ctx.dashboard_url}", services, root
    services.shutdown()
    ray.shutdown()


def _auth_token() -> str | None:
    """The cluster's token, as `ray get-auth-token` reads it (None when auth is off)."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    return loader.get_raw_token(ignore_auth_mode=True) if loader.has_token(ignore_auth_mode=True) else None


def test_actors_page_shows_raykv_actors_and_reprs(dashboard) -> None:
    chromium = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("RAYKV_REQUIRE_BROWSER"):
            raise
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    url, services, root = dashboard
    node = ray.get_runtime_context().get_node_id()
    expected = {  # name -> what its repr must say
        naming.CONTROL_ACTOR: "RaykvControl(shards=2",
        naming.directory_shard(0): "DirectoryShard(0/2",
        naming.directory_shard(1): "DirectoryShard(1/2",
        naming.object_store_actor(node): f"ObjectStore(node={node[:12]}",
        naming.fs_actor(root): f"FsRoot({root}",
    }
    assert {h["actor_name"] for h in services.holders()} == {naming.object_store_actor(node), naming.fs_actor(root)}

    SHOT.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1800, "height": 1000})
            page.goto(f"{url}/#/actors")
            token_box = page.get_by_role("textbox", name="Authentication Token")
            first_row = page.get_by_text(naming.CONTROL_ACTOR, exact=True)
            token_box.or_(first_row).first.wait_for(timeout=60_000)
            if token_box.is_visible():
                token = _auth_token()
                assert token, "the dashboard asks for a token but the cluster has none"
                token_box.fill(token)
                page.get_by_role("button", name="Submit").click()
            first_row.wait_for(timeout=60_000)
            for name in expected:
                page.get_by_text(name, exact=True).wait_for(timeout=30_000)
            page.screenshot(path=str(SHOT), full_page=True)
            rows = {}
            for row in page.locator("tr").all():
                cells = [c.strip() for c in row.locator("td").all_inner_texts()]
                for name in expected:
                    if name in cells:
                        rows[name] = cells
        finally:
            browser.close()
    print(f"\nscreenshot of the dashboard's Actors page: {SHOT}")
    assert SHOT.stat().st_size > 10_000
    for name, repr_start in expected.items():
        cells = rows.get(name)
        assert cells, f"{name} not in the Actors table"
        assert any(c.replace("\n", " ").startswith(repr_start) for c in cells), (name, cells)
        assert "ALIVE" in cells, (name, cells)
    os_cells = " ".join(rows[naming.object_store_actor(node)]).replace("\n", " ")
    assert "ObjectStoreActor" in os_cells and "capacity 8.0 MiB" in os_cells  # tier, node and capacity
    assert "capacity unlimited" in " ".join(rows[naming.fs_actor(root)])
    for name in expected:  # a repr is recorded once, at start: it must hold no counts that change
        assert not any(f"{count}=" in " ".join(rows[name]) for count in ("blocks", "files", "keys", "holders", "rules")), rows[name]
