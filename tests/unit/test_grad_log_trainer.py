"""``GradLogCallback`` on an unmodified Hugging Face ``Trainer`` (tiny BERT, CPU, dropout off):
the log holds every step's classes, and the training is the one without the callback."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")  # the Trainer needs it (a test dependency: pyproject's test extra)

from transformers import Trainer, TrainingArguments  # noqa: E402

from classgrad.store import read_log  # noqa: E402
from classgrad.workers.training.hf_callback import GradLogCallback  # noqa: E402
from tests.support.hf_models import hf_probe, tiny_bert  # noqa: E402

C = 6
STEPS = 4
BATCH = 8


def _train(model, data, tmp_path, callbacks) -> None:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()


def test_a_trainer_logs_every_steps_classes_and_trains_as_without_it(tmp_path):
    torch.manual_seed(0)
    model = tiny_bert(C, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs, labels = hf_probe("bert", C, per_class=6, seed=5)
    data = [{"input_ids": inputs["input_ids"][i], "attention_mask": inputs["attention_mask"][i], "labels": labels[i]}
            for i in range(len(labels))]  # fmt: skip
    plain = copy.deepcopy(model)
    url = str(tmp_path / "log.zarr")
    _train(model, data, tmp_path, [GradLogCallback(url, C, window=2, dim=16)])
    _train(plain, data, tmp_path, [])
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the callback leaves the step alone
    log = read_log(url)
    assert log["window"].tolist() == [0, 1] and log["steps"].tolist() == [[0, 2], [2, 4]]
    assert int(log["count"].sum()) == STEPS * BATCH
    assert np.isfinite(log["grads"]).all() and np.abs(log["grads"]).sum(axis=2)[log["count"] > 0].min() > 0
