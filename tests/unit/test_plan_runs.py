"""``packing.plan_runs``: runs of consecutive classes within a batch's samples and a padded
footprint of ``padded_batches`` batches (a training step's rows allow four: one backward); and
``ClassSamples``, where each class's samples are."""

from __future__ import annotations

import torch

from classgrad.workers.engines.partitioned.packing import ClassSamples, plan_runs


def test_the_padded_footprint_bounds_a_run_and_a_big_class_runs_alone():
    sizes = torch.tensor([4] + [1] * 150)  # 154 samples, padded 151 x 4 = 604
    assert plan_runs(sizes, 154, 1000) == ([(0, 77), (77, 151)], [])  # within 2 x 154: 77 classes of 4
    assert plan_runs(sizes, 154, 1000, padded_batches=4) == ([(0, 151)], [])  # within 616
    assert plan_runs(torch.tensor([1, 300, 2]), 420, 1000) == ([(0, 1), (2, 3)], [1])


def test_each_class_s_samples_in_probe_order_and_a_class_without_samples_empty():
    labels = torch.tensor([2, 0, 2, 3, 0, 2])
    samples = ClassSamples.from_labels(labels, torch.bincount(labels, minlength=5))
    assert [samples.of(c).tolist() for c in range(5)] == [[1, 4], [], [0, 2, 5], [3], []]
