"""The package import graph of classgrad, by layer: which package imports which, and any arrow up.

    .venv/bin/python scripts/import_graph.py        # prints the graph; exit 1 on an upward import or a cycle

Every import in the source folders (top-level, inside functions and under TYPE_CHECKING alike)
is read from the files with ``ast``, so nothing is imported to draw it. The layers: 0 the
foundation (src/classgrad: errors, units, progress bars, the version, config, store); 1 the
compute side (workers/); 2 the runtime (service/driver_runtime, workers/actor_runtime); 3 the analyses, the
CLI and the public API. ``tests/unit/test_layers.py`` runs it and uses its functions.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject.toml's [tool.setuptools] package-dir)
FOLDERS = {
    REPO / "src" / "classgrad": "classgrad",
    REPO / "service": "classgrad.service",
    REPO / "workers": "classgrad.workers",
}
# package (and everything below it unless listed itself) -> layer; a package imports only its own
# layer or lower ones. 0 the foundation (src/classgrad: errors, units, progress bars, the version,
# config, store); 1 compute (workers/); 2 runtime; 3 analyses, CLI, the public API. The modules of
# the root package listed here are nodes of their own (the root's __init__ is the API, on top).
LAYERS = {
    "classgrad.errors": 0,
    "classgrad.units": 0,
    "classgrad.progress_bar": 0,
    "classgrad.version": 0,
    "classgrad.registry": 0,
    "classgrad.config": 0,
    "classgrad.store": 0,
    "classgrad.workers": 1,
    "classgrad.workers.engines": 1,
    "classgrad.service": 2,
    "classgrad.service.driver_runtime": 2,
    "classgrad.workers.actor_runtime": 2,
    "classgrad.service.analysis": 3,
    "classgrad.service.commands": 3,
    "classgrad": 3,
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
    """The node ``module`` belongs to in the package graph: its package, or itself when it is a
    root module listed in ``LAYERS`` (the foundation's modules beside the API's ``__init__``)."""
    return module if path.name == "__init__.py" or module in LAYERS else module.rpartition(".")[0]


def layer_of(package: str) -> int:
    best = max((p for p in LAYERS if package == p or package.startswith(p + ".")), key=len)
    return LAYERS[best]


def imported_names(module: str, path: Path, modules: set[str]) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved); ``modules``
    are classgrad's own, to tell ``from pkg import module`` from ``from pkg import name``."""
    names = set()
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif (literal := import_module_literal(node)) is not None:
            names.add(literal)  # importlib.import_module("classgrad...."): an import like any other
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module or ""
            # `from pkg import module` imports the module (pkg's __init__ only as its parent, as
            # every import of a submodule does); `from pkg import name` imports pkg itself.
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(target)
    return names


def import_module_literal(node: ast.AST) -> str | None:
    """The module named by ``importlib.import_module("...")`` (or ``import_module("...")``) with a
    literal string; None for anything else (a user's factory path is not a literal)."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    value = node.args[0].value
    return value if name == "import_module" and isinstance(value, str) else None


def module_edges() -> dict[str, set[str]]:
    """importing module -> classgrad modules it imports."""
    modules = source_modules()
    return {
        module: {n for n in imported_names(module, path, set(modules)) if n in modules and n != module}
        for module, path in modules.items()
    }


def package_edges() -> dict[str, set[str]]:
    """importing package -> packages it imports from (classgrad's own only, self-edges dropped).

    A package's ``__init__`` that re-exports its own subpackages (``engines`` registering the
    partitioned engine) contains them rather than depends on them: those edges are left out.
    """
    modules = source_modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in module_edges().items():
        source = package_of(module, modules[module])
        for name in targets:
            target = package_of(name, modules[name])
            if target == source or (modules[module].name == "__init__.py" and target.startswith(source + ".")):
                continue
            edges[source].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges``, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def upward_edges() -> list[str]:
    """Every package edge that runs to a higher layer, as a sentence."""
    return [
        f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, targets in package_edges().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    ]


# The three sides of the stack; a function-level import across two of them would hide an edge of
# the graph from a reader (the test reads it, a person skimming the top of a file does not).
SIDES = (("classgrad.workers", "compute"), ("classgrad.service", "driver"), ("classgrad", "foundation"))
# The CLI's command modules import what a command needs inside its main(), so that `classgrad
# --help` and each command's parser stay quick (no torch, zarr or Ray for them).
LAZY_IMPORTERS = ("classgrad.service.commands",)


def side_of(module: str) -> str:
    if module == "classgrad" or module == "classgrad.__main__":
        return "api"
    return next(name for prefix, name in SIDES if module == prefix or module.startswith(prefix + "."))


def hidden_crossings() -> list[str]:
    """Imports inside functions from another side of the stack (outside ``LAZY_IMPORTERS``)."""
    modules = source_modules()
    found = []
    for module, path in modules.items():
        if module.startswith(LAZY_IMPORTERS):
            continue
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                # `from x import y`, `import x` and importlib.import_module("x") alike.
                if isinstance(node, ast.ImportFrom):
                    targets = [node.module or ""]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    literal = import_module_literal(node)
                    targets = [literal] if literal is not None else []
                for target in targets:
                    if target.startswith("classgrad") and side_of(target) != side_of(module):
                        line = getattr(node, "lineno", 0)
                        found.append(f"{path.relative_to(REPO)}:{line} imports {target} inside {fn.name}()")
    return found


def main() -> int:
    edges = package_edges()
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts}, key=lambda n: (layer_of(n), n))
    for node in nodes:
        down = sorted(edges.get(node, ()), key=lambda n: (layer_of(n), n))
        print(f"[{layer_of(node)}] {node}" + (" -> " + ", ".join(down) if down else ""))
    problems = upward_edges() + hidden_crossings()
    cycle = find_cycle(edges)
    if cycle:
        problems.append("cycle: " + " -> ".join(cycle))
    for line in problems:
        print("UP: " + line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
