"""The import graph of ``shardgraph/``, read statically with ``ast``, keeps the layers' promises.

Every import counts: module level, function level, and module names given as strings (to
``lazy_module``, ``import_module`` or a table of commands). Only ``if TYPE_CHECKING:`` blocks are
left out: they never run. Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so
those count too (except the importer's own packages, which are already running).

- the graph has no cycle;
- no plugin module imports another plugin's module, and every private module under
  ``parallelisms/`` and ``strategies/`` lives in its plugin's package, except the shared
  helpers (``parallelisms/_shared``), which serve several plugins and import none;
- the planner imports no plugin module, no ``train/`` module and no command module; ``train/``
  imports no command module but its own;
- one step path: ``ParallelModel.step``; no ``Plan.train_step``, no ``graphs/train_step.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "shardgraph"
PLUGIN_HOMES = ("shardgraph.parallelisms", "shardgraph.strategies")
#: helpers several plugins import (a layer between the plugins and core/), not a plugin
SHARED = "shardgraph.parallelisms._shared"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_lines(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return skip


def _resolve(module: str, level: int, importer: str) -> str:
    if not level:
        return module
    base = importer if _is_package(importer) else importer.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{module}" if module else base


def _named(importer: str) -> Iterator[str]:
    """The modules ``importer`` names, as written (before parents are added)."""
    tree = ast.parse(MODULES[importer].read_text())
    skip = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", node.level, importer)
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value  # "shardgraph.x.y" given to lazy_module, import_module or a table


def imports(importer: str) -> set[str]:
    """Every shardgraph module that importing ``importer`` may run."""
    own = {importer.rsplit(".", i)[0] for i in range(importer.count(".") + 1)}
    out = set()
    for name in _named(importer):
        if name not in MODULES:
            continue
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - own
    return out


GRAPH = {name: imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def owner(module: str) -> str | None:
    """The plugin a module belongs to: ``shardgraph.parallelisms.tp._styles`` -> ``tp``."""
    if module == SHARED or module.startswith(SHARED + "."):
        return None
    for home in PLUGIN_HOMES:
        if module.startswith(home + "."):
            return module[len(home) + 1:].split(".")[0]
    return None


def test_the_import_graph_has_no_cycle():
    assert _cycles() == []


def test_the_graph_sees_function_level_and_string_imports():
    # the test itself can fail: a cycle made only of a function-level import and a string
    # given to lazy_module is found
    fake = {"a": {"b"}, "b": {"a"}}
    saved = dict(GRAPH)
    try:
        GRAPH.clear()
        GRAPH.update(fake)
        assert _cycles() == [["a", "b"]]
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
    assert "shardgraph.plugins._spec" in GRAPH["shardgraph.strategies.fsdp2"] \
        or "shardgraph.plugins" in GRAPH["shardgraph.strategies.fsdp2"]


def test_no_plugin_module_imports_another_plugins_module():
    crossing = sorted(
        f"{a} -> {b}" for a, targets in GRAPH.items() if owner(a)
        for b in targets if owner(b) and owner(b) != owner(a))
    assert crossing == []


def test_the_shared_helpers_import_no_plugin_and_serve_several():
    shared = [m for m in MODULES if m == SHARED or m.startswith(SHARED + ".")]
    assert shared, f"{SHARED} is gone: update SHARED and CONTRIBUTING.md's layers"
    wrong = sorted(f"{a} -> {b}" for a in shared for b in GRAPH[a] if owner(b))
    assert wrong == []
    users = {owner(a) for a, targets in GRAPH.items() if owner(a) and set(shared) & targets}
    assert len(users) >= 2, f"only {users} use {SHARED}: move it into that plugin's package"


def test_a_private_module_serves_one_plugin_from_its_package():
    loose = sorted(m for m in MODULES if owner(m) and owner(m).startswith("_"))
    assert loose == [], "move each into the package of the plugin it serves"


@pytest.mark.parametrize("layer, banned", [
    ("shardgraph.planner", ("shardgraph.parallelisms", "shardgraph.strategies", "shardgraph.train",
                            "shardgraph.cli", "shardgraph.commands", "shardgraph.lightning")),
    ("shardgraph.train", ("shardgraph.cli", "shardgraph.commands", "shardgraph.lightning")),
    ("shardgraph.graphs", ("shardgraph.parallelisms", "shardgraph.strategies", "shardgraph.train",
                           "shardgraph.planner", "shardgraph.cli", "shardgraph.lightning")),
    ("shardgraph.core", ("shardgraph.plugins", "shardgraph.parallelisms", "shardgraph.strategies",
                         "shardgraph.graphs", "shardgraph.weights", "shardgraph.train")),
    (SHARED, ("shardgraph.strategies", "shardgraph.plugins", "shardgraph.graphs",
              "shardgraph.weights", "shardgraph.train")),
])
def test_layers_import_only_what_lies_below_them(layer, banned):
    # a ``__main__`` is a command's entry (``python -m shardgraph.train``), above every layer
    wrong = sorted(f"{a} -> {b}" for a, targets in GRAPH.items()
                   if (a == layer or a.startswith(layer + ".")) and not a.endswith(".__main__")
                   for b in targets if any(b == x or b.startswith(x + ".") for x in banned))
    assert wrong == []


def test_one_step_path():
    from shardgraph.graphs.plan import Plan
    from shardgraph.graphs.runtime import ParallelModel

    assert "shardgraph.graphs.train_step" not in MODULES
    assert not hasattr(Plan, "train_step")
    assert callable(ParallelModel.step)
