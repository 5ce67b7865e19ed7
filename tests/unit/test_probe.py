"""The probe set (``classgrad.workers.probe``): batches gathered channels-last."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine_cases import NUM_CLASSES
from classgrad.workers import zoo

@pytest.mark.parametrize("held", ["tensor", "tuple", "dataset"])
def test_probe_batches_gathered_channels_last_hold_the_same_values(held):
    from classgrad.workers.probe import ProbeSet

    x, y = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 5, 7), seed=1)
    extra = torch.arange(len(y) * 2.0).view(len(y), 2)  # not an image: left as it is
    data = {"tensor": (x, y), "tuple": ((x, extra), y), "dataset": torch.utils.data.TensorDataset(x, y)}[held]
    probe = ProbeSet(data)
    pick = torch.tensor([7, 2, 11, 2, 0])
    got, labels = probe.batch(pick, torch.device("cpu"), torch.float32, memory_format=torch.channels_last)
    images = got[0] if held == "tuple" else got
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert torch.equal(images, x[pick]) and torch.equal(labels, y[pick])
    if held == "tuple":
        assert torch.equal(got[1], extra[pick]) and got[1].is_contiguous()
    plain, _ = probe.batch(pick, torch.device("cpu"), torch.float32)
    assert plain.is_contiguous() if held != "tuple" else plain[0].is_contiguous()
