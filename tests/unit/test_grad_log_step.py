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
from classgrad.store.training_log.log_store import GradLogStore
from tests.support import grad_log_run as run


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 rows of the classes in the batch (the reference engine), and those classes."""
    ids = torch.unique(y)
    m = copy.deepcopy(model).double()
    return per_class_gradients(m, (x.double(), y), num_classes=run.C, classes=ids.tolist(), engine="reference"), ids


def _logged_run(
    url: str, model: nn.Module, steps: int, structure: str | None = None
) -> tuple[dict[int, torch.Tensor], list[float], GradLog]:
    """``steps`` steps of ``GradLog.step``; the float64 rows each window should hold, summed."""
    opt = torch.optim.SGD(model.parameters(), lr=run.LR)
    want: dict[int, torch.Tensor] = {}
    losses = []
    with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, structure=structure) as log:
        for step in range(steps):
            x, y = run.batch(step)
            ref, ids = _reference(model, x, y)
            want.setdefault(step // run.WINDOW, torch.zeros(run.C, ref.shape[1], dtype=torch.float64))[ids] += ref
            opt.zero_grad()
            losses.append(log.step(step, model, x, y, opt))
    return want, losses, log


@pytest.mark.parametrize("dropout", [False, True])
def test_a_logged_step_trains_as_a_plain_step_and_logs_its_rows(tmp_path, monkeypatch, dropout):
    """One backward, the rows sketched inside it (an MLP in eval mode, and in train mode with a
    dropout that draws: each sample forwarded once, its masks from the caller's generator)."""
    general = []
    route = GradLog._general
    monkeypatch.setattr(GradLog, "_general", lambda self, *a, **k: general.append(a[0]) or route(self, *a, **k))
    model, plain = run.fresh()[0], run.fresh()[0]
    if dropout:  # p ~ 0: the same numbers as without
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
    assert general == []


def test_a_log_takes_any_structure_that_projects_inside_the_backward(tmp_path, monkeypatch):
    """kronecker: its map planned from the model alone (the split by size: nothing measured), the
    rows projected inside the one backward, the windows the map of the float64 rows."""
    general = []
    route = GradLog._general
    monkeypatch.setattr(GradLog, "_general", lambda self, *a, **k: general.append(a[0]) or route(self, *a, **k))
    url = str(tmp_path / "log.zarr")
    want, _, log = _logged_run(url, run.fresh()[0], 3, structure="kronecker")
    assert log.projector.describe()["structure"] == "kronecker" and log.projector.describe()["allocation"] == "size"
    stored = read_log(url)
    for w, rows in want.items():
        # float32 rows (roundoff ~1e-7 relative) summed over 2 steps and projected.
        np.testing.assert_allclose(stored["grads"][w], log.projector.project(rows).numpy(), rtol=1e-5, atol=1e-6)
    assert general == []
    with pytest.raises(InputError, match="structure must be one of"):
        GradLog(str(tmp_path / "other.zarr"), run.fresh()[0], run.C, dim=run.DIM, structure="nope")


class _ChannelScale(nn.Module):
    """A layer with no rule: the hook path takes it as a module-VJP unit."""

    def __init__(self, channels: int):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("routes", ["cpu", "cuda"])
@pytest.mark.parametrize("sizes", ["unequal", "equal"])
def test_a_step_sums_the_per_class_gradients_its_rules_formed(tmp_path, monkeypatch, sizes, routes):
    """Convolutions whose per-class gradients are formed whole (a grouped backward per class size,
    or one for all classes; on a GPU's routes one over the zero-padded grid) and a module-VJP
    unit: the step's gradient of those layers is the sum of their per-class gradients over the
    classes, not a second pass of each layer; the Linear layer, whose rows are sketched from its
    factors, still forms its own. Trains as a plain step."""
    import contextlib

    from classgrad.workers.engines.layer_rules.rule_io import routes_as
    from classgrad.workers.engines.partitioned.hook_path import HookPath

    step_pass = []  # (layer type) of every layer a step's gradient formed again
    for name, at in (("_rule_sums", 5), ("_unit_grads", 4)):  # where each takes ``layers``
        original = getattr(HookPath, name)

        def spy(self, c, *args, _original=original, _at=at, **kwargs):
            if len(args) > _at and args[_at] is not None:  # the step's full columns
                step_pass.append(type(c.module).__name__)
            return _original(self, c, *args, **kwargs)

        monkeypatch.setattr(HookPath, name, spy)
    torch.manual_seed(6)
    classes = 10
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), _ChannelScale(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, classes),
    ).eval()  # fmt: skip
    plain = copy.deepcopy(model)
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=run.LR) for m in (model, plain))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 3, 6, 6, generator=g)
    if sizes == "equal":
        y = torch.arange(6).repeat(2)  # 6 classes of 2 samples
    else:
        y = torch.tensor([0, 1, 1, 2, 2, 2, 3, 5, 5, 7, 7, 7])  # classes of 1 to 3 samples
    gpu = routes_as("cuda") if routes == "cuda" else contextlib.nullcontext()
    with gpu, GradLog(str(tmp_path / "log.zarr"), model, classes, window=2, dim=run.DIM) as log:
        for step in range(3):
            opt.zero_grad()
            loss = log.step(step, model, x, y, opt)
            plain_opt.zero_grad()
            want = F.cross_entropy(plain(x), y)
            want.backward()
            plain_opt.step()
            # The batch's mean as the classes' means weighted by their counts: fp32 roundings.
            assert loss == pytest.approx(want.item(), rel=1e-6)
    assert step_pass == ["Linear"] * 3
    for a, b in zip(model.parameters(), plain.parameters()):
        # Sums over the classes of per-class gradients against autograd's one sum over the
        # batch: fp32 roundings in another order, 3 steps of SGD at lr 0.1.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


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


def test_a_skewed_batch_of_several_runs_steps_on_its_whole_gradient(tmp_path, monkeypatch):
    """A class with most of the batch runs alone, and small groups split the rest (``GROUP_BYTES``
    lowered: groups of 16 classes, as 1,000s of classes make them at dim 4,096): the step's
    gradient adds every run's part, the losses every block's."""
    from classgrad.workers.engines.partitioned import engine

    monkeypatch.setattr(engine, "GROUP_BYTES", 1)
    classes = 40
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, classes)).eval()
    plain = copy.deepcopy(model)
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=run.LR) for m in (model, plain))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(60, 8, generator=g)
    y = torch.cat([torch.zeros(31, dtype=torch.long), torch.arange(1, 30)])  # class 0: over half
    means = []
    with GradLog(str(tmp_path / "log.zarr"), model, classes, window=4, dim=run.DIM) as log:
        for step in range(3):
            opt.zero_grad()
            loss = log.step(step, model, x, y, opt)
            means.append(loss)
            plain_opt.zero_grad()
            want = F.cross_entropy(plain(x), y)
            want.backward()
            plain_opt.step()
            # The batch's mean as the classes' means weighted by their counts: fp32 roundings.
            assert loss == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(model.parameters(), plain.parameters()):
        # As in the balanced test: the rules' gradient against autograd's, fp32 roundings.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    stored = read_log(str(tmp_path / "log.zarr"))
    assert stored["count"][0].sum() == 3 * len(y)
    # Every block's class losses, times their counts: the steps' mean losses times the batch
    # (float64 sums of float32 losses).
    assert stored["loss_sum"][0].sum() == pytest.approx(sum(means) * len(y), rel=1e-9)


def test_non_finite_batches_are_not_logged_and_leave_gradients(tmp_path, caplog):
    model, opt = run.fresh()
    x, y = run.batch(0)
    bad = x.clone()
    bad[0, 0] = float("inf")
    with GradLog(str(tmp_path / "log.zarr"), model, run.C, window=run.WINDOW, dim=run.DIM) as log:
        log.add_batch(0, model, bad, y, opt)
        log.add_batch(1, model, x, y, opt)
    assert "step 0 has a non-finite loss or row: not logged" in caplog.text
    stored = read_log(str(tmp_path / "log.zarr"))
    np.testing.assert_array_equal(stored["count"][0], np.bincount(y.numpy(), minlength=run.C))
    assert np.isfinite(stored["grads"]).all()
    assert all(p.grad is None for p in model.parameters())


def test_a_resumed_log_keeps_the_map_it_was_written_with(tmp_path):
    model, opt = run.fresh()
    url = str(tmp_path / "log.zarr")
    with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, structure="sketch") as log:
        log.step(0, model, *run.batch(0), opt)
        log.step(1, model, *run.batch(1), opt)
    again = GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, start_step=2)  # structure unset
    assert again.map is None and again.projector.describe()["structure"] == "sketch"
    again.close()
    fresh = GradLog(str(tmp_path / "new.zarr"), model, run.C, dim=run.DIM)
    assert fresh.projector.describe()["structure"] == "tensorsketch"
