"""The packages' import graph: no two modules import each other, directly or through others (function-level
imports count; imports under `if TYPE_CHECKING:` do not, as they never run), and every module imports, each
package also first in a fresh interpreter (`converters` imports `jhybrid.config`, which runs `jhybrid/__init__.py`
and so the engine: an engine module importing `converters` at its top would make `import converters` fail)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jhybrid", "pallas_kernels", "converters")


def _modules() -> dict[str, str]:
    """{dotted module name: source path} for every .py file of PACKAGES (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules of `modules` that `module` imports anywhere in its source (`from pkg import name`: pkg.name
    where that is a module, else pkg)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 packages
                parts = module.split(".")[: None if path.endswith("__init__.py") else -1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        pending.extend(ast.iter_child_nodes(node))
    return (found & modules.keys()) - {module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert "jhybrid.engine.llm" in graph and "converters.name_maps" in graph  # the walk found the packages
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_imports(module):
    importlib.import_module(module)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_first(package):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
