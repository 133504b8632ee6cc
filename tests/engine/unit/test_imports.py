"""The engine's modules import each other in one direction only.

Imports under ``TYPE_CHECKING`` count: a cycle hidden there is still a cycle
for a reader, and the next runtime import along it breaks the engine's start.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sandboxes.engine

ENGINE_DIR = Path(sandboxes.engine.__file__).parent


def _engine_imports() -> dict[str, set[str]]:
    """Each engine module -> the engine modules it imports (relative imports only)."""
    modules = {path.stem: path for path in ENGINE_DIR.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        graph[name] = imported & set(modules)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it, or [] if there is none."""
    finished: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in finished:
            return []
        for imported in sorted(graph[name]):
            found = visit(imported, [*path, name])
            if found:
                return found
        finished.add(name)
        return []

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return []


def test_the_engines_modules_have_no_import_cycle():
    assert _cycle(_engine_imports()) == []


def test_pools_snapshots_and_the_desktop_know_the_engine_only_by_protocol():
    graph = _engine_imports()
    assert "engine" not in graph["pool"]
    assert "engine" not in graph["snapshots"]
    assert "engine" not in graph["desktop"]


def test_sizes_is_a_leaf_the_control_plane_can_import():
    assert _engine_imports()["sizes"] == set()
