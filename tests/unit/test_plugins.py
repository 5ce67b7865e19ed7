"""Names registered from outside the package are valid in a job file that imports their module
(``engine.plugins``), and only then; the job runs and resumes on Ray in
``tests/integration/test_plugins_job.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from classgrad.config import load_config
from classgrad.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TOY = ["loss.num_classes=4", "engine.kind=toy_partitioned", "loss.kind=toy_ce", "projection.structure=toy_sketch"]


@pytest.fixture
def taken_back():
    """The toy names are taken back after the test, whatever it imported."""
    yield
    if "tests.support.toy_plugins" in sys.modules:
        sys.modules["tests.support.toy_plugins"].unregister()


def test_a_job_file_names_what_its_plugins_register(taken_back):
    cfg = load_config(overrides=["engine.plugins=[tests.support.toy_plugins]", *TOY, "projection.dim=8"])
    assert (cfg.engine.kind, cfg.loss.kind, cfg.projection.structure) == ("toy_partitioned", "toy_ce", "toy_sketch")


def test_without_its_plugins_a_fresh_process_refuses_the_names_in_one_line():
    code = (
        "from classgrad.config import load_config\n"
        f"load_config(overrides={['loss.num_classes=4', 'engine.kind=toy_partitioned']!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0
    assert "engine.kind: Input should be 'auto', 'partitioned', 'dense' or 'reference'" in done.stderr


def test_a_plugin_that_cannot_be_imported_is_one_line():
    with pytest.raises(ConfigError, match=r"engine.plugins\[0\]: cannot import 'no_such_plugin' \(ModuleNotFoundError"):
        load_config(overrides=["loss.num_classes=4", "engine.plugins=[no_such_plugin]"])
