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


def test_a_failed_load_of_the_built_in_names_fails_again_not_short(monkeypatch):
    """The loader stays until it succeeds: a second check raises again, never "Input should be 'auto'"."""
    from classgrad.config import choices

    def broken() -> None:
        raise ImportError("torch is broken here")

    fresh = choices.Choices("engine.kind", fixed=("auto",))
    monkeypatch.setattr(choices, "_LOADER", [broken])
    for _ in range(2):
        with pytest.raises(ImportError, match="broken"):
            fresh.names()


def test_an_in_backward_structure_without_an_engine_is_one_line():
    import torch

    from classgrad.config import choices
    from classgrad.workers import zoo
    from classgrad.workers.engines import per_class_gradients
    from classgrad.workers.projection.structures import STRUCTURES, Structure, register_structure

    register_structure(Structure("toy_in_backward", True))
    try:
        model = zoo.mlp(4, in_features=6)
        data = (torch.randn(8, 6), torch.arange(4).repeat(2))
        with pytest.raises(ConfigError, match="no engine is registered for it"):
            per_class_gradients(model, data, num_classes=4, projection={"dim": 8, "structure": "toy_in_backward"})
    finally:
        STRUCTURES.pop("toy_in_backward")
        choices.STRUCTURES.discard("toy_in_backward")
