"""The package layout: one namespace, layers that import only downward, rooms of a livable size.

The import graph and its layers are ``scripts/import_graph.py``'s (every import read with
``ast``, functions' and TYPE_CHECKING's included, so nothing is imported to check it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph)
MAX_LINES = 600


def test_no_module_imports_the_folder_names():
    modules = graph.source_modules()
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for module, path in modules.items()
        for name in graph.imported_names(module, path, set(modules))
        if name.split(".")[0] in ("service", "workers")
    ]
    assert not offenders, offenders


def test_packages_import_only_their_own_layer_or_lower():
    upward = graph.upward_edges()
    assert not upward, upward


def test_no_import_inside_a_function_crosses_a_side_of_the_stack():
    """foundation <- workers <- service: every import from another side is at the top of the
    file, where a reader sees it (the CLI's command modules excepted, which import lazily)."""
    hidden = graph.hidden_crossings()
    assert not hidden, hidden


def test_the_import_graph_script_draws_every_layer_and_no_arrow_up():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "import_graph.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "UP:" not in done.stdout
    first = done.stdout.splitlines()
    assert first[0].startswith("[0] classgrad.") and any(
        line.startswith("[3] classgrad.service.commands") for line in first
    )


def test_the_package_import_graph_has_no_cycle():
    cycle = graph.find_cycle(graph.package_edges())
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_import_cycle():
    """Not even one hidden by a lazy import inside a function."""
    cycle = graph.find_cycle(graph.module_edges())
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("folder", ["service", "workers", "src"])
def test_no_source_file_is_over_the_size_limit(folder):
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / folder).rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_layer_check_sees_imports_inside_functions_and_by_import_module(tmp_path):
    """Issue 58: ``import x`` inside a function and ``importlib.import_module("classgrad...")``
    with a literal name were not checked (only ``from x import y`` was)."""
    source = tmp_path / "m.py"
    source.write_text(
        "import importlib\n"
        "def f():\n"
        "    import classgrad.service.driver_runtime.driver\n"
        "    importlib.import_module('classgrad.service.commands.cli')\n"
        "    importlib.import_module(user_path)\n"  # a user's factory: not a literal, not an edge
    )
    names = graph.imported_names("classgrad.store.m", source, set())
    assert {"classgrad.service.driver_runtime.driver", "classgrad.service.commands.cli"} <= names
    assert not any(n == "user_path" for n in names)
