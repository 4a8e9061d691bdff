"""No import cycle in the autotuner package, counting every import: module level, in functions,
and under TYPE_CHECKING (a cycle of design all the same). Read with `ast`: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "autotuner"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The package module `name` lives in: itself, or the nearest enclosing module."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `module` imports anywhere in its text."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {_owner(alias.name, known) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from package import module` imports the module
                full = f"{base}.{alias.name}"
                targets.add(full if full in known else _owner(base, known))
    return {t for t in targets if t is not None and t != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_type_checking_import(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    assert imported("pkg.b", tmp_path / "b.py", {"pkg.a": tmp_path, "pkg.b": tmp_path}) == {"pkg.a"}


def test_the_package_has_no_import_cycle():
    known = modules()
    graph = {module: imported(module, path, known) for module, path in known.items()}
    assert "autotuner.tuning.orchestrator" in graph and graph["autotuner.tuning.orchestrator"]
    assert cycles(graph) == []


def test_the_tuner_shows_its_layers_at_a_glance():
    """At most 10 modules directly in tuning/: the rest sit in the subpackages that the import-linter
    contract orders (pyproject.toml)."""
    direct = [p.name for p in (PACKAGE / "tuning").glob("*.py")]
    assert len(direct) <= 10, direct


def test_the_engine_shows_its_rooms_at_a_glance():
    """At most 12 modules directly in runtime/: the engine's entry points and what every room shares;
    the rest sit in its rooms (training/, saving/, measure/, progress/, online/)."""
    direct = [p.name for p in (PACKAGE / "runtime").glob("*.py")]
    assert len(direct) <= 12, direct
