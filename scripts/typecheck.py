"""Type-check classgrad with mypy, under the module names it is installed with.

    python scripts/typecheck.py          # what `make test` (and so CI) runs; exit 1 on any error

The repository keeps the package's code in three folders that install as one namespace
(src/classgrad -> classgrad, service/ -> classgrad.service, workers/ -> classgrad.workers).
mypy cannot follow setuptools' editable import hook, so this builds that tree once more out of
symbolic links under build/typecheck/ and checks it there; messages name the linked paths,
which mirror the repository's (classgrad/service/driver_runtime/... is service/driver_runtime/...).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "build" / "typecheck"
# installed name -> folder in the repository (pyproject.toml's [tool.setuptools] package-dir)
FOLDERS = {"classgrad": REPO / "src" / "classgrad", "service": REPO / "service", "workers": REPO / "workers"}


def build_tree() -> Path:
    """build/typecheck/classgrad: src/classgrad's files, with service/ and workers/ linked in."""
    if TREE.exists():
        shutil.rmtree(TREE)
    root = TREE / "classgrad"
    root.mkdir(parents=True)
    for entry in FOLDERS["classgrad"].iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for name in ("service", "workers"):
        (root / name).symlink_to(FOLDERS[name], target_is_directory=True)
    return TREE


def main() -> int:
    tree = build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "-p", "classgrad"]
    return subprocess.run(cmd, cwd=tree, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
