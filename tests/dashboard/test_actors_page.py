"""The Ray dashboard's Actors page, in a real headless Chromium, shows raykv's actors and their reprs.

Ray runs here with its dashboard on 127.0.0.1 and token authentication on
(Ray's default): the test types the cluster's token (what `ray get-auth-token`
prints) into the dashboard's dialog like a user, then reads the Actors table.
A screenshot is kept under artifacts/dashboard/ (ignored by git).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray

import raykv
from raykv.core import naming
from tests.waiting import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[2]
SHOT = REPO / "artifacts" / "dashboard" / "actors.png"
NS = "raykv-dashboard-test"
# Flags that work in containers without a display, a sandbox or network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium(system_binary) -> str:
    return system_binary(
        ("chromium", "chromium-browser"),
        "RAYKV_CHROMIUM",
        "RAYKV_REQUIRE_BROWSER",
        "Debian: apt-get install -y chromium",
    )


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory, free_port, make_ray_cluster):
    """A local Ray with its dashboard on 127.0.0.1 and raykv with an object_store and an fs tier."""
    # A head node like `ray start --head` makes, on ports of its own: the dashboard
    # agent's default port (52365) may be taken by another Ray on this machine,
    # and without its agent the dashboard cannot show an actor's logs.
    _, ctx = make_ray_cluster(
        head={
            "num_cpus": 1,
            "object_store_memory": 128 << 20,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port(),
        },
    )
    root = str(tmp_path_factory.mktemp("fs-root"))
    services = raykv.start(
        {
            "namespace": NS,
            "directory_shards": 2,
            "status_log_s": 1.0,
            "agent_view_all_keys": False,  # lookups reach the shards: their status lines show them
            "tiers": [
                {"type": "object_store", "capacity_bytes": 8 << 20},
                {"type": "fs", "root": root, "capacity_bytes": 0},
            ],
        }
    )
    yield f"http://{ctx.dashboard_url}", services, root
    services.shutdown()


def _auth_token() -> str | None:
    """The cluster's token, as `ray get-auth-token` prints it (None when there is none)."""
    # Ray's own CLI (the module of the `ray` console script), run by this interpreter.
    cli = [sys.executable, "-m", "ray.scripts.scripts", "get-auth-token"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _actor_id(url: str, name: str) -> str:
    """The id (hex) of the alive actor ``name`` of namespace NS, from Ray's state API."""
    from ray.util.state import list_actors

    found = list_actors(address=url, filters=[("name", "=", name), ("ray_namespace", "=", NS), ("state", "=", "ALIVE")])
    assert len(found) == 1, (name, found)
    return found[0].actor_id


def test_actors_page_shows_raykv_actors_and_reprs(dashboard, chromium) -> None:
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
    assert {h.actor_name for h in services.holders()} == {naming.object_store_actor(node), naming.fs_actor(root)}

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
        assert not any(
            f"{count}=" in " ".join(rows[name]) for count in ("blocks", "files", "keys", "holders", "rules")
        ), rows[name]


def _open_logged_in(page, url: str, ready) -> None:
    """Open ``url``; type the cluster's token into the dashboard's dialog if it asks."""
    page.goto(url)
    token_box = page.get_by_role("textbox", name="Authentication Token")
    token_box.or_(ready).first.wait_for(timeout=60_000)
    if token_box.is_visible():
        token = _auth_token()
        assert token, "the dashboard asks for a token but the cluster has none"
        token_box.fill(token)
        page.get_by_role("button", name="Submit").click()
    ready.wait_for(timeout=60_000)


def _traffic(services, root: str) -> None:
    """8 blocks stored into the object_store and fs tiers, looked up, 4 loaded back."""
    import numpy as np

    from raykv.core.factory import TierFactory
    from raykv.engine.primary import PrimaryRegion
    from raykv.engine.tier_driver import TierDriver

    region = PrimaryRegion(16, 64 << 10)
    region.array[:] = np.random.default_rng(0).integers(0, 256, region.array.shape, dtype=np.uint8)
    try:
        for cfg in ({"type": "object_store"}, {"type": "fs", "root": root, "fsync": False}):
            tier = TierFactory.create_tier(cfg, region.view, services=services)
            drv = TierDriver(tier)
            keys = raykv.prefix_keys(list(range(16 * 8)), 16, salt=cfg["type"])
            assert drv.store(keys, list(range(8))).success
            assert drv.lookup(keys) == [raykv.LookupResult.HIT] * 8
            assert drv.load(keys[:4], [8, 9, 10, 11]).success
            tier.shutdown()
    finally:
        region.close()


def _latest(text: str, prefix: str) -> str | None:
    lines = [ln for ln in text.splitlines() if f"raykv status: {prefix}" in ln]
    return lines[-1] if lines else None


def _figure(line: str, pattern: str) -> int:
    m = re.search(pattern, line)
    assert m, (pattern, line)
    return int(m.group(1))


def test_actor_pages_show_live_figures_after_traffic(dashboard, chromium) -> None:
    """After traffic, an actor's own page (its Logs) shows its live occupancy and
    traffic (the status line it logs every ``status_log_s``), not the figures of its start."""
    from playwright.sync_api import sync_playwright

    url, services, root = dashboard
    _traffic(services, root)
    node = ray.get_runtime_context().get_node_id()
    pages = {  # actor name -> status line prefix
        naming.object_store_actor(node): "object_store",
        naming.directory_shard(0): "directory shard 0/2",
        naming.fs_actor(root): "fs root",
    }
    seen: dict[str, str] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1800, "height": 1000})
            for name, prefix in pages.items():
                _open_logged_in(page, f"{url}/#/actors/{_actor_id(url, name)}", page.get_by_text(name, exact=True))
                body, line, asked = "", None, False

                def status_line_after_traffic() -> bool:
                    nonlocal body, line, asked
                    if asked:
                        page.reload()
                    asked = True
                    page.wait_for_timeout(2000)  # playwright's wait: the page's own events run meanwhile
                    body = page.inner_text("body")
                    line = _latest(body, prefix)
                    return bool(line and _figure(line, r": (\d+) (?:blocks|keys|files)") > 0)

                # the Logs section shows the actor's stderr; wait for a line after the traffic
                with contextlib.suppress(WaitTimeout):  # the assertion below names a missing line
                    wait_until(status_line_after_traffic, timeout_s=60, interval_s=0, what=f"a status line of {name}")
                if not line:
                    page.screenshot(path=str(SHOT.with_name("no_status_line.png")), full_page=True)
                assert line, f"no status line of {name} on its page: {body[-1500:]}"
                seen[name] = line
                if prefix == "object_store":
                    page.screenshot(path=str(SHOT.with_name("object_store_actor.png")), full_page=True)
        finally:
            browser.close()
    os_line = seen[naming.object_store_actor(node)]
    assert _figure(os_line, r": (\d+) blocks") == 8, os_line
    assert _figure(os_line, r"served (\d+)") >= 4, os_line
    assert "512.0 KiB / 8.0 MiB" in os_line, os_line
    shard_line = seen[naming.directory_shard(0)]
    assert _figure(shard_line, r": (\d+) keys") > 0 and _figure(shard_line, r", (\d+) found") > 0, shard_line
    assert _figure(seen[naming.fs_actor(root)], r": (\d+) files") == 8, seen[naming.fs_actor(root)]


def test_grafana_provisioning_picks_up_raykv_dashboard(dashboard) -> None:
    """raykv.start put the dashboard where Ray's Grafana provisioning (folder "Ray") loads dashboards."""
    import json

    import yaml

    ctx = ray.get_runtime_context()  # this session's dir is <temp dir>/<session name>
    session = Path(ctx.get_temp_dir(), ctx.get_session_name())
    provider = yaml.safe_load((session / "metrics/grafana/provisioning/dashboards/default.yml").read_text())
    folder = Path(provider["providers"][0]["options"]["path"])
    shipped = json.loads((REPO / "cluster_configs" / "grafana_raykv.json").read_text())
    assert json.loads((folder / "raykv_grafana_dashboard.json").read_text()) == shipped
    # Its panels use the data source Ray provisions (a variable of type prometheus, default source).
    ds = yaml.safe_load((session / "metrics/grafana/provisioning/datasources/default.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus" and ds["datasources"][0]["isDefault"]
