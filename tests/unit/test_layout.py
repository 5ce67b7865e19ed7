"""Parameter layout (``classgrad.workers.layout``): which parameters make up a row, in what
order, with what columns; flatten/unflatten between per-parameter gradients and rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from classgrad.service.errors import InputError
from tests.support.engine_cases import NUM_CLASSES
from classgrad.workers import zoo
from classgrad.workers.engines import build_engine
from classgrad.workers.layout import ParamLayout


def test_parameter_patterns_that_select_nothing_are_refused():
    model = zoo.mlp(NUM_CLASSES)
    with pytest.raises(InputError, match="select no parameters"):
        ParamLayout.from_model(model, include=["encoder.*"])
    with pytest.raises(InputError, match="select no parameters"):
        ParamLayout.from_model(model, exclude=["*"])
    with pytest.raises(InputError, match=r"pattern\(s\) \['nope'\] match no parameter"):
        ParamLayout.from_model(model, include=["0.*", "nope"])


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = zoo.mlp(NUM_CLASSES, in_features=8, hidden=16)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_parameters_without_a_path_to_the_loss_give_zero_columns(engine):
    model = WithUnused().eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine=engine)
    rows = eng.compute(range(NUM_CLASSES)).rows
    slot = eng.layout.slot("unused.weight")
    assert bool((rows[:, slot.offset : slot.offset + slot.size] == 0).all())
    assert bool((rows[:, : eng.layout.slot("body.0.weight").size] != 0).any())


def test_layout_order_selection_and_round_trip():
    model = zoo.small_cnn(NUM_CLASSES)
    full = ParamLayout.from_model(model)
    assert full.names == [n for n, _ in model.named_parameters()]
    assert full.dim == sum(p.numel() for p in model.parameters())
    offsets = [s.offset for s in full.slots]
    assert offsets == sorted(offsets) and offsets[0] == 0
    heads = ParamLayout.from_model(model, include=["head.*"], exclude=["*.bias"])
    assert heads.names == ["head.0.weight", "head.2.weight"]
    rows = torch.randn(3, heads.dim)
    views = heads.unflatten(rows)
    assert views["head.2.weight"].shape == (3, NUM_CLASSES, 32)
    assert torch.equal(heads.flatten([views[n] for n in heads.names], batch_dims=1), rows)


def test_frozen_parameters_are_skipped_unless_named():
    model = zoo.mlp(NUM_CLASSES)
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in ParamLayout.from_model(model).names
    assert ParamLayout.from_model(model, include=["0.weight"]).names == ["0.weight"]

