"""A projection structure from outside the package, on no built-in structure
(``tests/support/layer_gauss.py``: one module, its registration in it): a job file names it and its
own key, and the job runs, resumes and is scored like one of the built-ins'."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from classgrad.config import ProjectionConfig
from classgrad.service.analysis.score_driver import score_rows
from classgrad.service.analysis.verify import verify_store
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.actor_runtime.query import query_rows
from classgrad.workers.engines.partitioned.hook_plan import HookPlan
from classgrad.workers.gradients import per_class_gradients
from classgrad.workers.layout import ParamLayout
from classgrad.workers.zoo import synthetic_probe
from tests.support.engine_cases import max_relative_error
from tests.support.jobs import MLP_JOB_CLASSES, mlp_job, run_without_ray

PLUGIN = "tests.support.layer_gauss"


@pytest.fixture
def layer_gauss():
    import tests.support.layer_gauss as plugin

    yield plugin
    from classgrad.workers.engines.layer_rules.registry import PROJECTED_SUMS
    from classgrad.workers.projection import STRUCTURES

    STRUCTURES.unregister(plugin.NAME)  # a process's other tests see the built-in names only
    PROJECTED_SUMS.unregister(plugin.NAME)
    sys.modules.pop(PLUGIN, None)  # the next import registers it again


def test_its_own_keys_are_checked_by_the_job_file(layer_gauss):
    options = ProjectionConfig.model_validate({"dim": 8, "structure": "layer_gauss", "layers": ["0"]})
    assert isinstance(options, layer_gauss.LayerGaussOptions) and options.layers == ["0"]
    with pytest.raises(ValueError, match="of structure layer_gauss"):
        ProjectionConfig.model_validate({"dim": 8, "structure": "layer_gauss", "rest": "dense"})
    with pytest.raises(ValueError, match="of structure tensorsketch"):
        ProjectionConfig.model_validate({"dim": 8, "structure": "tensorsketch", "layers": ["0"]})
    with pytest.raises(ValueError, match="layers"):
        ProjectionConfig.model_validate({"dim": 8, "structure": "layer_gauss", "layers": 3})


def test_a_job_of_it_runs_resumes_and_is_scored(tmp_path, layer_gauss):
    proj = {"dim": 20, "seed": 3, "structure": "layer_gauss", "layers": ["0", "4"]}
    config = mlp_job(tmp_path, projection=proj, engine={"plugins": [PLUGIN]})
    store = run_without_ray(config)
    record = store.attrs["projection"]
    assert record["structure"] == "layer_gauss" and [u["param"] for u in record["units"]] == ["0.weight", "4.weight"]
    assert record["rest_params"] == ["2.weight", "2.bias"]

    # The stored rows are the map of the float64 rows: float32 rows summed over 3 samples and
    # mapped by 20-column products (about 1e-6 relative).
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    full = per_class_gradients(model.double(), probe, num_classes=MLP_JOB_CLASSES, engine="reference")
    model.float()
    layout = ParamLayout.from_model(model)
    plan = HookPlan.plan(model, layout)
    assert plan is not None
    names = {m: n for n, m in model.named_modules()}
    covered = {names[m] for m in plan.layers}
    options = ProjectionConfig.model_validate(proj)
    kmap = layer_gauss.GaussMap(layout.slots, dict(model.named_modules()), covered, options, None)
    want = kmap.project_full(full)
    stored = torch.from_numpy(store.rows(np.arange(MLP_JOB_CLASSES))).double()
    assert max_relative_error(stored, want) <= 1e-5
    assert verify_store(config.store.url).code == 0

    # A resume computes nothing and keeps the record (the map is planned again and checked).
    again = run_without_ray(config)
    assert again.attrs["projection"] == record
    np.testing.assert_array_equal(again.rows(np.arange(MLP_JOB_CLASSES)), stored.float().numpy())

    # Scored: query rows by the same map (the store's own row definition), then a top-k.
    x, y = synthetic_probe(**config.data.kwargs)
    x, y = x[:6], y[:6]
    queries = query_rows(store, (x, y)).rows.numpy()
    result = score_rows([store], [queries], method="dot", top_k=3, executor="local")
    brute = queries.astype(np.float64) @ stored.numpy().T
    # float32 products over 20 terms: within 1e-5 of the largest score.
    atol = 1e-5 * np.abs(brute).max()
    np.testing.assert_allclose(result.scores.double().numpy(), -np.sort(-brute, axis=1)[:, :3], rtol=0, atol=atol)
