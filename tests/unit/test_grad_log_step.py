"""``GradLog.step`` and ``GradLog.add_batch``: a training step and its per-class rows from one
forward and one backward (rows sketched inside it), against a plain training loop and the
float64 per-class rows; the general route where the hook path cannot take the batch.

The run is ``tests/support/grad_log_run.py``'s (a seeded MLP, windows of 2 steps, 32 columns).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from classgrad import GradLog, per_class_gradients
from classgrad.errors import InputError
from classgrad.store import read_log
from classgrad.store.grad_log import GradLogStore
from tests.support import grad_log_run as run


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 rows of the classes in the batch (the reference engine), and those classes."""
    ids = torch.unique(y)
    m = copy.deepcopy(model).double()
    return per_class_gradients(m, (x.double(), y), num_classes=run.C, classes=ids.tolist(), engine="reference"), ids


def _logged_run(url: str, model: nn.Module, steps: int) -> tuple[dict[int, torch.Tensor], list[float], GradLog]:
    """``steps`` steps of ``GradLog.step``; the float64 rows each window should hold, summed."""
    opt = torch.optim.SGD(model.parameters(), lr=run.LR)
    want: dict[int, torch.Tensor] = {}
    losses = []
    with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM) as log:
        for step in range(steps):
            x, y = run.batch(step)
            ref, ids = _reference(model, x, y)
            want.setdefault(step // run.WINDOW, torch.zeros(run.C, ref.shape[1], dtype=torch.float64))[ids] += ref
            opt.zero_grad()
            losses.append(log.step(step, model, x, y, opt))
    return want, losses, log


@pytest.mark.parametrize("dropout", [False, True])
def test_a_logged_step_trains_as_a_plain_step_and_logs_its_rows(tmp_path, monkeypatch, dropout):
    """One backward (an MLP in eval mode: the sketched route) or the general route (train-mode
    dropout couples nothing but draws masks: the route that runs the batch as given)."""
    general = []
    route = GradLog._general_step
    monkeypatch.setattr(GradLog, "_general_step", lambda self, *a: general.append(a[0]) or route(self, *a))
    model, plain = run.fresh()[0], run.fresh()[0]
    if dropout:  # p = 0: the same numbers as without, by the general route
        model = nn.Sequential(*model, nn.Dropout(0.0)).train()
        model[-1].p = 1e-12  # a dropout that draws: samples_independent says no
        plain = copy.deepcopy(model)
    url = str(tmp_path / "log.zarr")
    torch.manual_seed(0)
    want, losses, log = _logged_run(url, model, 5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=run.LR)
    torch.manual_seed(0)
    for step in range(5):
        x, y = run.batch(step)
        plain_opt.zero_grad()
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        plain_opt.step()
        # The batch's mean loss as sum over classes of n_c / N times the class's mean: fp32
        # roundings in another order (about 1e-7 relative).
        assert losses[step] == pytest.approx(float(loss), rel=1e-6)
    for a, b in zip(model.parameters(), plain.parameters()):
        # The step's gradient formed by the layer rules (one G^T X a layer, or the rows' weighted
        # sum) against autograd's: fp32 roundings, 5 steps of SGD at lr 0.1.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    stored = read_log(url)
    assert stored["window"].tolist() == [0, 1, 2] and stored["steps"].tolist() == [[0, 2], [2, 4], [4, 5]]
    for w, rows in want.items():
        expected = log.projector.project(rows).numpy()
        # float32 rows (roundoff ~1e-7 relative) summed over 2 steps and sketched.
        np.testing.assert_allclose(stored["grads"][w], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stored["lr_grads"][w], run.LR * expected, rtol=1e-5, atol=1e-7)
    counts = np.zeros((3, run.C), dtype=np.int64)
    for step in range(5):
        counts[step // run.WINDOW] += np.bincount(run.batch(step)[1].numpy(), minlength=run.C)
    np.testing.assert_array_equal(stored["count"], counts)
    assert general == (list(range(5)) if dropout else [])


def test_add_batch_logs_the_rows_and_leaves_the_gradients(tmp_path):
    model = run.fresh()[0]
    opt = torch.optim.SGD(model.parameters(), lr=run.LR)
    x, y = run.batch(0)
    F.cross_entropy(model(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    url = str(tmp_path / "log.zarr")
    with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM) as log:
        log.add_batch(0, model, x, y, opt)
        ref, ids = _reference(model, x, y)
        full = torch.zeros(run.C, ref.shape[1], dtype=torch.float64)
        full[ids] = ref.double()
        expected = log.projector.project(full).numpy()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    # float32 rows sketched inside the backward against float64 rows sketched after.
    np.testing.assert_allclose(read_log(url)["grads"][0], expected, rtol=1e-5, atol=1e-6)


def test_a_step_of_a_log_of_some_parameters_is_refused(tmp_path):
    model, opt = run.fresh()
    log = GradLog(str(tmp_path / "log.zarr"), model, run.C, dim=run.DIM, params=["2.*"])
    with pytest.raises(InputError, match="trains every trainable parameter"):
        log.step(0, model, *run.batch(0), opt)


def test_windows_written_in_the_background_are_the_same_windows(tmp_path, monkeypatch):
    """The writer thread (the default on a GPU) writes what the steps' own writes would, marks a
    window done only after its arrays, and a failed write surfaces at ``close``."""
    stored = {}
    for background in (False, True):
        model, opt = run.fresh()
        url = str(tmp_path / f"log{background}.zarr")
        with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, background=background) as log:
            for step in range(5):
                opt.zero_grad()
                log.step(step, model, *run.batch(step), opt)
        stored[background] = read_log(url)
    for name, value in stored[False].items():
        # The same steps in the same process, shapes and order: the same bits.
        np.testing.assert_array_equal(stored[True][name], value)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(GradLogStore, "write_window", broken)
    model, opt = run.fresh()
    log = GradLog(str(tmp_path / "broken.zarr"), model, run.C, window=1, dim=run.DIM, background=True)
    log.step(0, model, *run.batch(0), opt)
    log.step(1, model, *run.batch(1), opt)  # window 0's write fails on the writer thread
    with pytest.raises(OSError, match="disk full"):
        log.close()


def test_a_step_under_torch_distributed_is_refused(tmp_path, monkeypatch):
    """DistributedDataParallel averages gradients in its own backward, which ``step`` does not
    run: a rank's step would follow its own batch alone."""
    from types import SimpleNamespace

    from classgrad.workers.training import grad_log

    one_rank = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 0)
    monkeypatch.setattr(grad_log, "dist", SimpleNamespace(**vars(one_rank), barrier=lambda: None))
    model, opt = run.fresh()
    log = GradLog(str(tmp_path / "log.zarr"), model, run.C, dim=run.DIM)
    with pytest.raises(InputError, match="DistributedDataParallel averages the gradient"):
        log.step(0, model, *run.batch(0), opt)
