"""Builders for the tests of the commands on a training log (``tests/unit/test_log_analysis.py``).

Holds ``MODEL_KWARGS`` (``zoo.mlp``'s arguments of ``grad_log_run``'s model, for ``--model``),
``whole_row_log`` (a log of whole rows, no sketch, over a few steps of ``grad_log_run``'s run)
and ``query_rows64`` (float64 query rows by the reference engine, one example at a time, sketched
by the map ``GradLog`` makes for the log's width and seed, checked equal to the log's record).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from classgrad import GradLog, PerClassGradScaler, per_class_gradients
from tests.support import grad_log_run as run

MODEL_KWARGS = {"num_classes": run.C, "in_features": 8, "hidden": 16, "seed": 3}  # run.fresh()'s model


def whole_row_log(url: str, steps: int) -> None:
    """Steps ``[0, steps)`` of ``grad_log_run``'s run logged with whole rows (``dim=None``)."""
    model, opt = run.fresh()
    scaler = PerClassGradScaler()
    with GradLog(url, model, run.C, window=run.WINDOW, dim=None) as log:
        for step in range(steps):
            x, y = run.batch(step)
            opt.zero_grad()
            rows, ids = scaler.step_batch(model, x, y, opt, num_classes=run.C)
            log.add(step, rows, ids, lr=run.LR, counts=torch.bincount(y, minlength=run.C)[ids])


def query_rows64(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, record: dict | None, scratch_url: str
) -> np.ndarray:
    """Each example's cross-entropy gradient in float64 (the reference engine, the example its
    own probe set), sketched by the map ``record`` describes (None: whole rows), as ``GradLog``
    builds it for a log at ``scratch_url``."""
    m64 = copy.deepcopy(model).double()
    rows = torch.cat(
        [
            per_class_gradients(
                m64, (x[i : i + 1].double(), y[i : i + 1]), num_classes=run.C, classes=[int(y[i])], engine="reference"
            ).double()
            for i in range(len(y))
        ]
    )
    if record is None:
        return rows.numpy()
    # The log's map as GradLog makes it (on a scratch log of the same model, width and seed).
    scratch = GradLog(scratch_url, model, run.C, window=run.WINDOW, dim=record["dim"], seed=record["seed"])
    assert scratch.projector is not None and scratch.projector.describe() == record  # the very map logged
    return scratch.projector.project(rows).double().numpy()
