"""What `pip install .` puts on a user's machine: the `classgrad` tree, nothing named `service`/`workers`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {
    "classgrad": REPO / "src" / "classgrad",
    "classgrad.service": REPO / "service",
    "classgrad.workers": REPO / "workers",
}


def test_the_package_list_names_every_source_folder():
    """pyproject.toml lists packages by hand (the folders map onto one namespace); a new
    subpackage that is not listed would be missing from a non-editable install."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {k: str(v.relative_to(REPO)) for k, v in FOLDERS.items()}
    folders = {
        ".".join([name, *init.parent.relative_to(folder).parts])
        for name, folder in FOLDERS.items()
        for init in folder.rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == folders


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A non-editable install of this checkout (no dependencies: they come from the venv)."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return site


def test_a_non_editable_install_holds_only_the_classgrad_tree(installed):
    top = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert top == {"classgrad"}
    for module in (
        "errors.py",
        "store/grad_store.py",
        "service/commands/cli.py",
        "workers/engines/__init__.py",
        "py.typed",
    ):
        assert (installed / "classgrad" / module).exists(), module


def test_a_users_own_workers_and_service_change_nothing(installed, tmp_path):
    """A user's `workers.py` and `service/` in the working directory once shadowed classgrad's."""
    (tmp_path / "workers.py").write_text("raise SystemExit('the user workers.py was imported')\n")
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "__init__.py").write_text("raise SystemExit('the user service/ was imported')\n")
    script = (
        "import sys, classgrad\n"
        "from classgrad import per_class_gradients, open_store, JobConfig, load_config, run_job\n"
        "import classgrad.service.commands.cli, classgrad.workers.actor_runtime.actor\n"
        f"assert classgrad.__file__.startswith({str(installed)!r}), classgrad.__file__\n"
        "assert 'workers' not in sys.modules and 'service' not in sys.modules\n"
        "print(classgrad.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert done.stdout.strip() == project["version"]
