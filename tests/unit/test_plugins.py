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


def test_an_in_backward_structure_without_its_plan_and_sums_is_refused_at_registration():
    from classgrad.workers.structures import ProjectionStructure, register_structure

    class Half(ProjectionStructure):
        name = "toy_in_backward"
        in_backward = True

    with pytest.raises(ValueError, match="projects in the backward: it needs plan and layer_sums"):
        register_structure(Half())

    class Neither(ProjectionStructure):
        name = "toy_finished"

    with pytest.raises(ValueError, match="needs a projector of finished rows"):
        register_structure(Neither())


def test_toy_structures_give_the_rows_of_the_structures_they_subclass(taken_back):
    """One subclass and one registration each: a finished-row structure and one projecting inside
    the backward (its engine and layer sums from the registration) give the built-ins' rows."""
    import torch

    import tests.support.toy_plugins  # noqa: F401 - registers the toys
    from classgrad.workers import zoo
    from classgrad.workers.gradients import per_class_gradients

    model = zoo.mlp(6, in_features=5, hidden=8)
    data = (torch.randn(18, 5, generator=torch.Generator().manual_seed(0)), torch.arange(6).repeat(3))
    for toy, builtin in (("toy_sketch", "sketch"), ("toy_tensorsketch", "tensorsketch")):
        got, want = (
            per_class_gradients(model, data, num_classes=6, projection={"dim": 16, "structure": name, "seed": 3})
            for name in (toy, builtin)
        )
        # The same map and the same sums, run the same way in one process: the same numbers.
        assert torch.equal(got, want), toy
