"""The rooms of docs/ARCHITECTURE.md hold: the core imports no demo, benchmark
or tier code; a tier imports no other tier; the README's layout lists the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Modules of raykv/ that operate or showcase the product and may import anything.
OUTSIDE_CORE = ("raykv/bench/", "raykv/demo/", "raykv/ops/cli.py")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _py(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_core_imports_no_demo_benchmark_or_tier() -> None:
    offenders = []
    for path in _py("raykv"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(OUTSIDE_CORE):
            continue
        for mod in _imports(path):
            if mod.startswith(("raykv.demo", "raykv.bench", "tiers")):
                offenders.append(f"{rel} imports {mod}")
    assert not offenders, offenders


def test_tiers_import_no_other_tier() -> None:
    offenders = []
    for path in _py("tiers"):
        parts = path.relative_to(ROOT / "tiers").parts
        if len(parts) < 2:
            continue
        mine = f"tiers.{parts[0]}"
        for mod in _imports(path):
            if mod.startswith("tiers.") and not (mod == mine or mod.startswith(mine + ".")):
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, offenders


def test_readme_layout_names_existing_paths_and_every_package() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    named = [line.split()[0] for line in block.splitlines() if line.strip()]
    missing = [p for p in named if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"README layout names paths that do not exist: {missing}"
    packages = {
        p.parent.relative_to(ROOT).as_posix() + "/" for p in _py("raykv") + _py("tiers") if p.name == "__init__.py"
    }
    unlisted = sorted(
        p for p in packages if p not in named and p.count("/") == 2 and not p.startswith("raykv/integrations/")
    )
    assert not unlisted, f"packages missing from the README layout: {unlisted}"
    # the architecture page exists and names the same rooms
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for room in (
        "raykv/core/placement.py",
        "raykv/holders/holder_actor.py",
        "raykv/engine/actor_tier.py",
        "raykv/services/control.py",
    ):
        assert room in arch and (ROOT / room).exists(), room
    assert re.search(r"## The path of one block", arch)
