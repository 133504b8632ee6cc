"""The project's modules import one way: no cycle at run time, and no layer reaching up.

What is read: every module of the shipped packages, and every import in it at
any depth (a function's too: an import moved into a function to dodge a cycle
is still that cycle), except those under ``if TYPE_CHECKING:``, which only a
type checker runs.  No root, no service: the files are parsed, not imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each package and the directory that holds it (the SDK is a distribution of its own, in sdk/).
PACKAGES = {"console": ROOT, "sandboxes": ROOT, "billing": ROOT, "grading": ROOT, "forkyard": ROOT / "sdk"}

# (importer, imported, why it must never be): each is a prefix of dotted module names.
NEVER = [
    ("sandboxes.engine", "django", "the engine runs without Django"),
    ("sandboxes.engine", "console", "the engine runs without the control plane"),
    ("sandboxes.engine", "billing", "the engine runs without the control plane"),
    ("sandboxes.engine", "grading", "the engine runs without the control plane"),
    ("sandboxes", "grading", "grading is built on sandboxes, never the reverse (the host agent takes its passes)"),
    ("billing", "grading", "billing's records name endpoints by string"),
    ("forkyard", "grading", "the SDK needs only httpx"),
    ("grading.services", "grading.tasks", "services queue commands by name (sandboxes.commands)"),
    ("grading.services", "grading.api", "services know nothing of HTTP"),
    ("grading.selectors", "grading.services", "reads never write"),
    ("grading.worker", "grading.api", "the worker knows nothing of HTTP"),
    ("grading.gateway", "grading.services", "the gateway answers; its callers record (grading.api.replies)"),
    ("forkyard", "django", "the SDK needs only httpx"),
    ("forkyard", "console", "the SDK needs only httpx"),
    ("forkyard", "sandboxes", "the SDK needs only httpx"),
    ("forkyard", "billing", "the SDK needs only httpx"),
    ("sandboxes.services", "sandboxes.tasks", "services queue commands by name (sandboxes.commands)"),
    ("sandboxes.services", "sandboxes.worker", "the API's side never runs the worker's"),
    ("sandboxes.services", "sandboxes.api", "services know nothing of HTTP"),
    ("sandboxes.services", "sandboxes.views", "services know nothing of pages"),
    ("sandboxes.transitions", "sandboxes.commands", "a transition changes state; its caller queues work"),
    ("sandboxes.transitions", "sandboxes.services", "transitions are below services"),
    ("sandboxes.transitions", "sandboxes.worker", "transitions are below the worker"),
    ("sandboxes.transitions", "sandboxes.engine_link", "a transition never calls an engine"),
    ("sandboxes.commands", "sandboxes.tasks", "commands are sent by name"),
    ("sandboxes.commands", "sandboxes.worker", "commands are sent by name"),
    ("sandboxes.selectors", "sandboxes.services", "reads never write"),
    ("sandboxes.selectors", "sandboxes.transitions", "reads never write"),
    ("sandboxes.selectors", "sandboxes.commands", "reads never queue"),
    ("sandboxes.worker", "sandboxes.services", "the worker is driven by commands, not by the API's services"),
    ("sandboxes.worker", "sandboxes.tasks", "tasks call the worker, not the reverse"),
    ("sandboxes.worker", "sandboxes.api", "the worker knows nothing of HTTP"),
    ("sandboxes.worker", "sandboxes.views", "the worker knows nothing of pages"),
    ("sandboxes.board.protocol", "django", "tools and benchmarks decode the board's frames without Django"),
    ("billing.models", "sandboxes", "billing's records name sandboxes by string"),
]
# Imports of project modules inside a function, each with the reason it cannot be at the top.
INSIDE_A_FUNCTION = {
    ("sandboxes.engine.network", "sandboxes.engine.rtnl"): "pyroute2 (half a second of CPU) loads after the engine starts",
    ("console.apps", "console.keys"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("console.apps", "console.models"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("sandboxes.apps", "sandboxes.agent"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("sandboxes.apps", "sandboxes.gateway_access"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("sandboxes.apps", "console.keys"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("sandboxes.apps", "console.models"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    (
        "sandboxes.engine.__main__",
        "sandboxes.engine.data_tokens",
    ): "the CLI's client commands start without loading the engine",
    ("sandboxes.engine.__main__", "sandboxes.engine.gateway"): "the CLI's client commands start without loading the engine",
    ("grading.apps", "grading.agent"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("grading.apps", "grading.signals"): "AppConfig.ready(): Django's place to connect signals, once models are loaded",
    ("console.channel_layer", "console.models"): "Channels loads its layer from the settings, before Django's apps are ready",
    ("sandboxes.engine.__main__", "sandboxes.engine.engine"): "the CLI's client commands start without loading the engine",
    ("sandboxes.engine.__main__", "sandboxes.engine.server"): "the CLI's client commands start without loading the engine",
    (
        "sandboxes.engine.__main__",
        "sandboxes.engine.template_store",
    ): "the CLI's client commands start without loading the engine",
    ("sandboxes.engine.__main__", "sandboxes.engine.cgroups"): "the CLI's client commands start without loading the engine",
    ("sandboxes.engine.__main__", "sandboxes.engine.recovery"): "the CLI's client commands start without loading the engine",
    ("sandboxes.engine.__main__", "sandboxes.engine.store"): "the CLI's client commands start without loading the engine",
}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package, home in PACKAGES.items():
        for path in (home / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(home).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, inside a function?) for each import of ``module`` that runs."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # ``from package import module`` imports the module; ``from module import name`` the module.
                found.append((f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, bool]]]]:
    """Project module -> the project modules it imports; and every import of each module."""
    modules = project_modules()
    known = set(modules)
    every = {module: imports_of(module, path, known) for module, path in modules.items()}
    graph = {module: {name for name, _ in imported if name in known and name != module} for module, imported in every.items()}
    return graph, every


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for following in sorted(graph.get(node, ())):
            if following not in index:
                connect(following)
                low[node] = min(low[node], low[following])
            elif following in on_stack:
                low[node] = min(low[node], index[following])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_checker_finds_a_cycle_and_its_members() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_resolves_relative_imports_and_skips_type_checking(tmp_path: Path) -> None:
    source = tmp_path / "services.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import selectors\n"
        "from ..models import Sandbox\n"
        "if TYPE_CHECKING:\n    from ..api import answers\n"
        "def later():\n    from ..worker import bring_up\n"
    )
    known = {"sandboxes.selectors", "sandboxes.models", "sandboxes.api.answers", "sandboxes.worker.bring_up"}
    found = imports_of("sandboxes.services.sandboxes", source, known)
    assert ("sandboxes.selectors", False) in found and ("sandboxes.models", False) in found
    assert ("sandboxes.worker.bring_up", True) in found
    assert not any(name.startswith("sandboxes.api") for name, _ in found)


def test_no_import_cycle_among_the_projects_modules() -> None:
    graph, _ = import_graph()
    assert len(graph) > 100, "the checker read the project"
    assert cycles(graph) == [], "modules that import each other in a loop: make one of them import the other, not both"


def test_no_layer_imports_what_it_must_not() -> None:
    _, every = import_graph()
    broken = [
        f"{module} imports {name}: {why}"
        for module, imported in sorted(every.items())
        for name, _ in imported
        for importer, forbidden, why in NEVER
        if _within(module, importer) and _within(name, forbidden)
    ]
    assert broken == []


def test_project_imports_inside_functions_have_a_reason() -> None:
    graph, every = import_graph()
    unexplained = sorted(
        f"{module} imports {name} inside a function"
        for module, imported in every.items()
        for name, in_function in imported
        if in_function and name in graph and (module, name) not in INSIDE_A_FUNCTION
    )
    assert unexplained == []
    stale = [
        pair
        for pair in INSIDE_A_FUNCTION
        if not any(pair == (module, name) for module in every for name, inside in every[module] if inside)
    ]
    assert stale == [], "reasons kept for imports that no longer exist"
