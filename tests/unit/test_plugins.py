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
    from classgrad.workers.projection import ProjectionStructure, register_structure

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


@pytest.fixture
def toy_structure_names():
    """Structures a test registers by hand are taken back afterwards (names and sums)."""
    names: list[str] = []
    yield names
    from classgrad.workers.engines.layer_rules.registry import PROJECTED_SUMS
    from classgrad.workers.projection import STRUCTURES

    for name in names:
        STRUCTURES.unregister(name)  # and from config.choices
        PROJECTED_SUMS.unregister(name)


def _in_backward_structure(name: str, sums):
    """A structure projecting in the backward by the default's map, its units naming ``name`` (so
    they dispatch to ``sums`` alone, not to the default's)."""
    from classgrad.workers.projection import ProjectionStructure
    from classgrad.workers.projection.tensorsketch.tensorsketch_structure import TensorSketchOptions, plan_map

    class Toy(ProjectionStructure):
        in_backward = True
        options = TensorSketchOptions
        unit_family = name

        def plan(self, projection, slots, modules, covered, measure):
            kmap = plan_map(slots, modules, covered, projection)
            for unit in kmap.units:
                unit.structure = name
            return kmap

        def layer_sums(self):
            return sums

    Toy.name = name
    return Toy()


def test_an_in_backward_structure_without_outer_sums_is_refused_at_registration_naming_it(toy_structure_names):
    from classgrad.workers.engines.layer_rules.registry import ProjectedSums
    from classgrad.workers.projection import STRUCTURES, register_structure
    from classgrad.workers.projection.tensorsketch import tensorsketch_sums as sketch_sums

    toy_structure_names.append("toy_no_outer")
    no_outer = ProjectedSums(outer=None, embedding=sketch_sums.sketched_table_sums)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^projection structure 'toy_no_outer' .*: its layer_sums\(\) gives no outer"):
        register_structure(_in_backward_structure("toy_no_outer", no_outer))
    # The old mapping by family name is no ProjectedSums: refused the same way.
    old = {"outer": sketch_sums.sketched_outer_sums}
    with pytest.raises(ValueError, match=r"'toy_no_outer' .*: its layer_sums\(\) gives dict, not a ProjectedSums"):
        register_structure(_in_backward_structure("toy_no_outer", old))
    assert "toy_no_outer" not in STRUCTURES


def test_an_in_backward_structure_whose_sums_take_the_wrong_arguments_is_refused_at_registration(
    toy_structure_names,
):
    from classgrad.workers.engines.layer_rules.registry import PROJECTED_SUMS, ProjectedSums
    from classgrad.workers.projection import register_structure
    from classgrad.workers.projection.tensorsketch import tensorsketch_sums as sketch_sums

    def two_arguments(factors, out) -> None:  # outer sums take (factors, out, unit)
        raise AssertionError("never called")

    toy_structure_names.append("toy_bad_outer")
    with pytest.raises(
        ValueError, match=r"'toy_bad_outer' .*: its outer sums .*two_arguments.* do not take the 3 arguments"
    ):
        register_structure(_in_backward_structure("toy_bad_outer", ProjectedSums(outer=two_arguments)))
    # The same for an optional family: the table sums take (module, seen, out, unit).
    wrong_table = ProjectedSums(outer=sketch_sums.sketched_outer_sums, embedding=sketch_sums.sketched_outer_sums)
    with pytest.raises(ValueError, match=r"its embedding sums .* do not take the 4 arguments of embedding layers"):
        register_structure(_in_backward_structure("toy_bad_outer", wrong_table))
    assert "toy_bad_outer" not in PROJECTED_SUMS


def test_a_structure_without_embedding_sums_on_an_embedding_is_one_line_naming_it_and_the_family(
    toy_structure_names,
):
    import torch
    from torch import nn

    from classgrad.workers.engines.layer_rules.registry import ProjectedSums
    from classgrad.workers.gradients import per_class_gradients
    from classgrad.workers.projection import register_structure
    from classgrad.workers.projection.tensorsketch import tensorsketch_sums as sketch_sums

    toy_structure_names.append("toy_outer_only")
    register_structure(_in_backward_structure("toy_outer_only", ProjectedSums(outer=sketch_sums.sketched_outer_sums)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 4))
    ids = torch.randint(0, 10, (12, 3), generator=torch.Generator().manual_seed(1))
    data = (ids, torch.arange(4).repeat(3))
    projection = {"dim": 8, "structure": "toy_outer_only", "seed": 3}
    with pytest.raises(ConfigError) as caught:
        per_class_gradients(model, data, num_classes=4, projection=projection)
    message = str(caught.value)
    assert "\n" not in message
    assert "projection structure 'toy_outer_only' has no sums for embedding layers" in message
