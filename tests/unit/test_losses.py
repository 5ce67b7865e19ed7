"""Loss kinds (``classgrad.workers.losses``): each kind's per-class losses against a hand
computation, micro-batch contributions that add up to L, target checks and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from classgrad.config import BUILTIN_LOSS_KINDS
from classgrad.errors import InputError
from classgrad.workers import zoo
from classgrad.workers.gradients import build_engine
from classgrad.workers.losses import LOSSES, DenseLoss, PartitionedLoss, create_loss, partitioned_loss, register_loss
from tests.support.engine_cases import NUM_CLASSES

# Three samples, three classes; class 2 has no samples.
OUTPUTS = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
LABELS = torch.tensor([0, 1, 0])


def _total(loss, outputs, targets, split: int) -> torch.Tensor:
    """L from two micro-batches, ``[:split]`` and ``[split:]``, as every engine sums it."""
    norm = loss.norm(targets)
    return sum(loss.batch_losses(outputs[s], targets[s], norm) for s in (slice(None, split), slice(split, None)))


def test_unknown_loss_kind_lists_choices_and_registry_matches_config():
    with pytest.raises(InputError, match="choices: bce, cross_entropy, logit"):
        create_loss("hinge", 10)
    assert set(LOSSES) == set(BUILTIN_LOSS_KINDS)


def test_bce_needs_multi_hot_targets():
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    with pytest.raises(InputError, match=r"multi-hot of shape \[N, 6\]"):
        build_engine(zoo.mlp(NUM_CLASSES, in_features=8), data, num_classes=NUM_CLASSES, loss="bce")


def test_cross_entropy_is_the_mean_over_each_class_samples():
    loss = create_loss("cross_entropy", 3)
    assert loss.partitioned and isinstance(loss, PartitionedLoss)

    def ce(row: list[float], label: int) -> float:
        return math.log(sum(math.exp(v) for v in row)) - row[label]

    rows = OUTPUTS.tolist()
    want = [(ce(rows[0], 0) + ce(rows[2], 0)) / 2, ce(rows[1], 1), 0.0]  # class 2: no samples, L = 0
    assert loss.counts(LABELS).tolist() == [2, 1, 0]
    for split in (1, 2):
        # float64 log-sum-exp against math.log/exp: a few float64 roundoffs.
        torch.testing.assert_close(
            _total(loss, OUTPUTS, LABELS, split), torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12
        )


def test_logit_is_the_probe_mean_of_each_output_column():
    loss = create_loss("logit", 3)
    assert not loss.partitioned and loss.per_column and loss.linear_in_outputs
    want = torch.tensor([1.5 / 3, 2.0 / 3, 2.0 / 3], dtype=torch.float64)
    assert loss.counts(LABELS).tolist() == [3, 3, 3]  # every sample touches every class
    # Micro-batch means weighted n_b / N: float64 sums of three terms, a roundoff or two.
    torch.testing.assert_close(_total(loss, OUTPUTS, LABELS, 1), want, rtol=1e-12, atol=1e-12)


def test_bce_is_the_probe_mean_of_binary_cross_entropy_per_column():
    loss = create_loss("bce", 3)
    assert loss.per_column and not loss.linear_in_outputs
    targets = torch.tensor([[1, 0, 0], [0, 1, 1], [1, 0, 0]])
    pairs = list(zip(OUTPUTS.tolist(), targets.tolist(), strict=True))
    want = [sum(math.log1p(math.exp(z[c])) - t[c] * z[c] for z, t in pairs) / 3 for c in range(3)]
    # float64 logaddexp against math.log1p/exp: a few float64 roundoffs.
    torch.testing.assert_close(
        _total(loss, OUTPUTS, targets, 2), torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    with pytest.raises(InputError, match=r"multi-hot of shape \[N, 3\]"):
        loss.validate_targets(LABELS)


def test_half_precision_outputs_give_float32_losses():
    for kind in ("cross_entropy", "logit", "bce"):
        loss = create_loss(kind, 3)
        targets = LABELS if kind != "bce" else torch.eye(3)[LABELS]
        out = loss.batch_losses(OUTPUTS.half(), targets, loss.norm(targets))
        assert out.dtype == torch.float32, kind


def test_user_losses_partitioned_or_dense():
    @partitioned_loss
    def squared_own_logit(outputs, labels):
        return outputs.gather(1, labels[:, None]).squeeze(1) ** 2

    loss = create_loss(squared_own_logit, 3)
    assert isinstance(loss, PartitionedLoss)
    # Own logits 1.0 and 0.0 for class 0, 2.0 for class 1: exact in binary floating point.
    assert _total(loss, OUTPUTS, LABELS, 1).tolist() == [0.5, 4.0, 0.0]
    dense = create_loss(lambda outputs, targets: (outputs**2).mean(dim=0), 3)
    assert isinstance(dense, DenseLoss) and not dense.per_column
    # Micro-batch means of 2 and 1 samples weighted 2/3 and 1/3: the probe mean of the squares
    # by hand (1 + 0.25 + 0) / 3 ..., up to a float64 roundoff or two.
    want = torch.tensor([1.25 / 3, 4.0 / 3, 10.0 / 3], dtype=torch.float64)
    torch.testing.assert_close(_total(dense, OUTPUTS, LABELS, 2), want, rtol=1e-12, atol=1e-12)


def test_losses_of_the_wrong_shape_are_refused():
    bad_sample = create_loss(partitioned_loss(lambda outputs, labels: outputs.sum()), 3)
    with pytest.raises(InputError, match=r"per-sample loss returned shape \(\), expected \(3,\)"):
        bad_sample.batch_losses(OUTPUTS, LABELS, bad_sample.norm(LABELS))
    bad_dense = create_loss(lambda outputs, targets: outputs.sum(dim=1), 4)
    with pytest.raises(InputError, match=r"returned shape \(3,\), expected \(4,\)"):
        bad_dense.batch_losses(OUTPUTS, LABELS, bad_dense.norm(LABELS))
    with pytest.raises(InputError, match=r"integer class labels of shape \[N\]"):
        create_loss("cross_entropy", 3).validate_targets(LABELS.double())
    with pytest.raises(InputError, match="loss.num_classes must be > 0"):
        create_loss("logit", 0)


def test_loss_kinds_by_import_path_and_the_registry():
    loss = create_loss("tests.support.engine_cases:multi_margin", NUM_CLASSES)
    assert isinstance(loss, PartitionedLoss) and loss.name == "tests.support.engine_cases:multi_margin"
    with pytest.raises(InputError, match="is not callable"):
        create_loss("tests.support.engine_cases:NUM_CLASSES", NUM_CLASSES)
    with pytest.raises(ValueError, match="already registered"):
        register_loss("logit")(lambda c: create_loss("logit", c))
