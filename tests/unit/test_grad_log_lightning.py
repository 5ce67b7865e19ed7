"""``GradLogLightningCallback`` on an unmodified Lightning ``Trainer`` (a small MLP, CPU): the
training is the one without the callback, the log holds each step's per-class rows at the step's
parameters, a fit resumed from a checkpoint resumes the log, and what it cannot log is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")  # a test dependency (pyproject's test extra)

from classgrad import per_class_gradients  # noqa: E402
from classgrad.errors import InputError  # noqa: E402
from classgrad.store import read_log  # noqa: E402
from classgrad.workers import zoo  # noqa: E402
from classgrad.workers.training.lightning_callback import GradLogLightningCallback  # noqa: E402

C = 4
STEPS = 4
WINDOW = 2
LR = 0.1
BATCHES = [
    (torch.randn(12, 8, generator=g), torch.randint(0, C, (12,), generator=g))
    for g in (torch.Generator().manual_seed(100 + i) for i in range(2))
]


class Classifier(L.LightningModule):
    def __init__(self, batch_norm: bool = False):
        super().__init__()
        self.net = zoo.mlp(C, in_features=8, hidden=16, seed=3)
        if batch_norm:  # train-mode BatchNorm: the rows take the general route and move its statistics
            self.net.insert(1, torch.nn.BatchNorm1d(16))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = (batch["x"], batch["labels"]) if isinstance(batch, dict) else batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class KeepParameters(L.Callback):
    """Each step's parameters as the step sees them (before the optimizer steps)."""

    def __init__(self):
        self.steps: list[torch.nn.Module] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(copy.deepcopy(pl_module.net))


def _fit(module, callbacks, max_steps=STEPS, ckpt_path=None, batches=BATCHES, **options):
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("batch_norm", [False, True], ids=["mlp", "batchnorm"])
def test_a_fit_with_the_callback_trains_as_without_it(tmp_path, batch_norm):
    logged, plain = Classifier(batch_norm), Classifier(batch_norm)
    _fit(logged, [GradLogLightningCallback(str(tmp_path / "log.zarr"), C, window=WINDOW, dim=16)])
    _fit(plain, [])
    for a, b in zip(logged.state_dict().values(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # parameters and BatchNorm's buffers: bit-identical
    assert read_log(str(tmp_path / "log.zarr"))["window"].tolist() == [0, 1]


def test_the_log_holds_each_steps_rows_at_its_parameters(tmp_path):
    url = str(tmp_path / "log.zarr")
    kept = KeepParameters()
    _fit(Classifier(), [kept, GradLogLightningCallback(url, C, window=WINDOW, dim=None)])  # whole rows
    want = np.zeros((STEPS // WINDOW, C, sum(p.numel() for p in kept.steps[0].parameters())))
    for step, net in enumerate(kept.steps):
        x, y = BATCHES[step % len(BATCHES)]
        ids = torch.unique(y)
        ref = per_class_gradients(
            net.double(), (x.double(), y), num_classes=C, classes=ids.tolist(), engine="reference"
        )
        want[step // WINDOW, ids.numpy()] += ref.numpy()
    log = read_log(url)
    assert log["steps"].tolist() == [[0, 2], [2, 4]]
    # float32 rows (engine roundoff ~1e-7 relative) against float64 ones, summed over 2 steps.
    np.testing.assert_allclose(log["grads"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log["lr_grads"], LR * want, rtol=1e-5, atol=1e-7)
    counts = sum(np.bincount(BATCHES[s % 2][1].numpy(), minlength=C) for s in range(WINDOW))
    assert np.array_equal(log["count"], np.stack([counts, counts]))


def test_a_dict_batch_with_labels_logs_as_a_pair(tmp_path):
    pairs, dicts = str(tmp_path / "pairs.zarr"), str(tmp_path / "dicts.zarr")
    _fit(Classifier(), [GradLogLightningCallback(pairs, C, window=WINDOW, dim=16)])
    # The other tensors of the dict are the forward's keyword arguments: forward(x=...).
    as_dicts = [{"x": x, "labels": y} for x, y in BATCHES]
    _fit(Classifier(), [GradLogLightningCallback(dicts, C, window=WINDOW, dim=16)], batches=as_dicts)
    np.testing.assert_array_equal(read_log(pairs)["grads"], read_log(dicts)["grads"])  # the same ops on the same data


def test_a_resumed_fit_resumes_the_log_at_its_global_step(tmp_path):
    # One batch an epoch: Lightning 2.6, resuming from a checkpoint saved after a fit that ended at
    # an epoch's end, replays that epoch's first batch; with one batch, both fits see the same data.
    one = BATCHES[:1]
    clean, resumed = str(tmp_path / "clean.zarr"), str(tmp_path / "resumed.zarr")
    _fit(Classifier(), [GradLogLightningCallback(clean, C, window=WINDOW, dim=16)], batches=one)
    first = _fit(
        Classifier(), [GradLogLightningCallback(resumed, C, window=WINDOW, dim=16)], max_steps=WINDOW, batches=one
    )
    ckpt = str(tmp_path / "step2.ckpt")
    first.save_checkpoint(ckpt)
    assert read_log(resumed)["window"].tolist() == [0]
    # A fresh module and trainer from the checkpoint: the log opens at global_step 2 and keeps
    # window 0 (opened at step 0 it would drop it).
    callback = GradLogLightningCallback(resumed, C, window=WINDOW, dim=16)
    second = _fit(Classifier(), [callback], ckpt_path=ckpt, batches=one)
    assert second.global_step == STEPS
    a, b = read_log(clean), read_log(resumed)
    assert b["window"].tolist() == [0, 1]
    for name in ("grads", "lr_grads", "count", "steps"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)  # the same steps, the same process


def test_what_it_cannot_log_is_refused_in_one_line(tmp_path):
    callback = GradLogLightningCallback(str(tmp_path / "log.zarr"), C, window=WINDOW)
    with pytest.raises(InputError, match="accumulate_grad_batches=2") as caught:
        _fit(Classifier(), [callback], accumulate_grad_batches=2)
    assert "\n" not in str(caught.value)
    manual = Classifier()
    manual.automatic_optimization = False
    with pytest.raises(InputError, match="manual optimization"):
        _fit(manual, [callback])
