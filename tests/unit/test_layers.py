"""The package layout: one namespace, layers that import only downward, rooms of a livable size.

Every import in the source folders (top-level, inside functions and under TYPE_CHECKING alike)
is read from the files with ``ast``, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# folder -> the package it installs as (pyproject.toml's [tool.setuptools] package-dir)
FOLDERS = {REPO / "src" / "classgrad": "classgrad", REPO / "service": "classgrad.service",
           REPO / "workers": "classgrad.workers"}
# package (and everything below it unless listed itself) -> layer; a package imports only its own
# layer or lower ones. 0 bottom: errors, config, store; 1 compute; 2 runtime; 3 analyses, CLI, API.
LAYERS = {
    "classgrad.service": 0, "classgrad.service.config": 0, "classgrad.service.store": 0,
    "classgrad.workers": 1, "classgrad.workers.engines": 1,
    "classgrad.service.runtime": 2, "classgrad.workers.runtime": 2,
    "classgrad.service.analysis": 3, "classgrad.service.commands": 3, "classgrad": 3,
}
MAX_LINES = 600


def source_modules() -> dict[str, Path]:
    """Installed module name -> file, for every module of the three folders."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def layer_of(package: str) -> int:
    best = max((p for p in LAYERS if package == p or package.startswith(p + ".")), key=len)
    return LAYERS[best]


def imported_names(module: str, path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    names = set()
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def package_edges() -> dict[str, set[str]]:
    """importing package -> packages it imports from (classgrad's own only, self-edges dropped)."""
    modules = source_modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        source = package_of(module, path)
        for name in imported_names(module, path):
            if name in modules:
                target = package_of(name, modules[name])
                if target != source:
                    edges[source].add(target)
    return edges


def test_no_module_imports_the_folder_names():
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for module, path in source_modules().items()
        for name in imported_names(module, path)
        if name.split(".")[0] in ("service", "workers")
    ]
    assert not offenders, offenders


def test_packages_import_only_their_own_layer_or_lower():
    upward = [
        f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, targets in package_edges().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    ]
    assert not upward, upward


def test_the_package_import_graph_has_no_cycle():
    edges = package_edges()
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(package: str) -> list[str] | None:
        state[package] = "open"
        path.append(package)
        for target in sorted(edges.get(package, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[package] = "done"
        path.pop()
        return None

    for package in sorted(edges):
        if package not in state:
            cycle = visit(package)
            assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("folder", ["service", "workers", "src"])
def test_no_source_file_is_over_the_size_limit(folder):
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / folder).rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
