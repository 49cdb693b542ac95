"""The rooms of docs/ARCHITECTURE.md hold: each package imports only the rooms its
row allows (imports inside functions count), no raykv module is part of an import
circle, only raykv/integrations/ imports vLLM, a tier imports no other tier, the
README's layout lists the tree, and no class is over 250 lines."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVERYTHING = "*"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path) -> Iterator[tuple[str, int]]:
    """(module, line) of every import in ``path``, at any depth; ``from a import b``
    yields ``a`` and ``a.b`` (b may be a submodule); relative imports resolved."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for top in ("raykv", "tiers") for p in sorted((ROOT / top).rglob("*.py"))}


def _graph() -> dict[str, set[str]]:
    """raykv and tiers modules -> the raykv and tiers modules they import."""
    modules = _sources()
    return {m: {i for i, _ in _imported(p) if i in modules and i != m} for m, p in modules.items()}


def _rooms() -> dict[str, set[str] | str]:
    """docs/ARCHITECTURE.md's rooms table: room path -> the room paths it may import (or EVERYTHING)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    rooms: dict[str, set[str] | str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        may = cells[2]
        allowed: set[str] | str = (
            EVERYTHING if may == "everything" else set(re.findall(r"`([^`]+)`", may)) if may.startswith("`") else set()
        )
        if not allowed and may not in ("nothing of raykv", "everything"):
            raise AssertionError(f"rooms table: cannot read 'may import' of {cells[0]}: {may!r}")
        for room in re.findall(r"`([^`]+)`", cells[0]):
            rooms[room] = allowed
    assert rooms, "docs/ARCHITECTURE.md has no rooms table"
    return rooms


def _room_of(module: str, rooms: dict[str, set[str] | str]) -> str | None:
    """The most specific room holding ``module`` (``tiers/<name>/`` for every tier)."""
    path = module.replace(".", "/")
    if path.startswith("tiers/") and path.count("/") >= 1:
        return "tiers/<name>/"
    best = None
    for room in rooms:
        if room.endswith("/__init__.py"):  # the package module itself, not its package
            if path == room[: -len("/__init__.py")]:
                return room
            continue
        stem = room[:-3] if room.endswith(".py") else room.rstrip("/")
        if (path == stem or path.startswith(stem + "/")) and (best is None or len(room) > len(best)):
            best = room
    return best


def test_every_module_lives_in_a_room() -> None:
    rooms = _rooms()
    homeless = sorted(m for m in _sources() if m not in ("raykv", "tiers") and _room_of(m, rooms) is None)
    assert not homeless, f"modules in no room of docs/ARCHITECTURE.md: {homeless}"


def test_rooms_import_only_what_the_table_allows() -> None:
    rooms = _rooms()
    offenders = []
    for module, imports in _graph().items():
        room = _room_of(module, rooms)
        if room is None or rooms[room] == EVERYTHING:
            continue
        allowed = rooms[room]
        for dep in imports:
            dep_room = _room_of(dep, rooms)
            if dep_room is None or dep_room == room:
                continue
            if room == "tiers/<name>/" and dep_room == room:
                continue
            if dep_room not in allowed:
                offenders.append(f"{module} ({room}) imports {dep} ({dep_room})")
    assert not offenders, "\n".join(sorted(offenders))


def test_no_import_circle_among_raykv_modules() -> None:
    graph = {m: {d for d in deps if d.startswith("raykv")} for m, deps in _graph().items() if m.startswith("raykv")}
    cycles = _cycles(graph)
    assert not cycles, f"import circles (imports inside functions count): {cycles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    """The check above can fail: a two-module circle held together by an import
    inside a function is found."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    graph = {}
    for name in ("a", "b"):
        tree = ast.parse((tmp_path / f"{name}.py").read_text())
        graph[name] = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    assert _cycles(graph) == [["a", "b"]]


def test_only_integrations_import_vllm() -> None:
    offenders = []
    for module, path in _sources().items():
        if module.startswith("raykv.integrations"):
            continue
        for imported, line in _imported(path):
            if imported == "vllm" or imported.startswith("vllm."):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not offenders, offenders


def test_tiers_import_no_other_tier() -> None:
    offenders = []
    for module, path in _sources().items():
        parts = module.split(".")
        if parts[0] != "tiers" or len(parts) < 3:
            continue
        mine = ".".join(parts[:2])
        for imported, line in _imported(path):
            if imported.startswith("tiers.") and not (imported == mine or imported.startswith(mine + ".")):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not offenders, offenders


def test_readme_layout_names_existing_paths_and_every_package() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    named = [line.split()[0] for line in block.splitlines() if line.strip()]
    missing = [p for p in named if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"README layout names paths that do not exist: {missing}"
    packages = {
        p.parent.relative_to(ROOT).as_posix() + "/"
        for top in ("raykv", "tiers")
        for p in (ROOT / top).rglob("__init__.py")
    }
    unlisted = sorted(
        p for p in packages if p not in named and p.count("/") == 2 and not p.startswith("raykv/integrations/")
    )
    assert not unlisted, f"packages missing from the README layout: {unlisted}"
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert re.search(r"## The path of one block", arch)


def test_tests_mirror_the_packages() -> None:
    """Each test module of a raykv package sits in that package's folder under tests/raykv/."""
    stray = sorted(p.name for p in (ROOT / "tests" / "raykv").glob("test_*.py"))
    assert not stray, f"tests/raykv/ holds test modules outside any package folder: {stray}"
    folders = {p.name for p in (ROOT / "tests" / "raykv").iterdir() if p.is_dir() and not p.name.startswith("__")}
    packages = {p.name for p in (ROOT / "raykv").iterdir() if (p / "__init__.py").exists()}
    assert folders <= packages, f"tests/raykv/ folders with no raykv package: {sorted(folders - packages)}"


#: Longest class (lines, docstrings included) in raykv/ and tiers/: past it, a class holds more than one job.
MAX_CLASS_LINES = 250


def test_no_class_is_over_the_line_limit() -> None:
    big = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for top in ("raykv", "tiers")
        for path in sorted((ROOT / top).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"
