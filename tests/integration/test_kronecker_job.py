"""A Kronecker-projected job on a local Ray with 2 actors: the actors reuse the driver's recorded
split and store the rows ``per_class_gradients`` gives with the same projection options (the rest
projected densely, or by the sparse sign sketch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import per_class_gradients
from tests.support.engine_cases import max_relative_error

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.mark.parametrize("rest", ["dense", "sketch"])
def test_two_actors_store_the_python_api_rows(job_config, rest):
    proj = {"structure": "kronecker", "dim": 96, "seed": 4, "rest": rest}
    config = job_config(projection=proj)
    summary = JobDriver(config).run()
    store = open_store(config.store.url)
    assert summary.status == "complete" and store.is_complete and store.dim == 96
    record = store.attrs["projection"]
    assert record["structure"] == "kronecker" and record["units"]  # the small CNN's convolutions
    assert record["rest"] == rest and ("rest_sketch" in record) == (rest == "sketch")
    model = build_model(config.model.factory, config.model.kwargs, mode=config.model.mode)
    probe = build_probe(config.data.factory, config.data.kwargs, config.data.batch_size)
    want = per_class_gradients(model, probe, num_classes=48, projection=proj)
    rows = torch.from_numpy(store.rows(np.arange(48)))
    # Same split (measured the same way on the same CPU), same factors; classes are grouped into
    # runs differently (shards of 4 vs one call) and the memory format is timed: float32 order.
    assert max_relative_error(rows, want) <= 1e-5
