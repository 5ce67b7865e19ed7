"""Parameter layout (``classgrad.workers.layout``): which parameters make up a row, in what
order, with what columns; flatten/unflatten between per-parameter gradients and rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from classgrad.errors import InputError
from classgrad.store.core.params import ParamSlot
from classgrad.workers import zoo
from classgrad.workers.gradients import build_engine
from classgrad.workers.layout import ParamLayout
from tests.support.engine_cases import NUM_CLASSES


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


def test_slots_are_contiguous_and_name_their_columns():
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 4))
    layout = ParamLayout.from_model(model)
    assert [(s.name, s.shape, s.offset, s.size) for s in layout.slots] == [
        ("0.weight", (2, 3), 0, 6),
        ("0.bias", (2,), 6, 2),
        ("2.weight", (4, 2), 8, 8),
        ("2.bias", (4,), 16, 4),
    ]
    assert layout.dim == 20 and len(layout) == 4
    assert layout.to_list()[2] == {"name": "2.weight", "shape": [4, 2], "offset": 8, "size": 8}
    with pytest.raises(InputError, match=r"unknown parameter 'nope' \(layout has: 0.weight, 0.bias"):
        layout.slot("nope")


def test_exclude_wins_over_include():
    model = zoo.mlp(NUM_CLASSES)
    layout = ParamLayout.from_model(model, include=["0.*"], exclude=["*.bias"])
    assert layout.names == ["0.weight"]


def test_flatten_puts_each_gradient_in_its_columns_and_none_as_zeros():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    layout = ParamLayout.from_model(model)
    grads = [torch.full((5, 2, 3), 1.0), None, torch.full((5, 1, 2), 3.0), torch.full((5, 1), 4.0)]
    rows = layout.flatten(grads, batch_dims=1)
    assert rows.shape == (5, 11) and rows.dtype == torch.float32
    want = torch.tensor([1.0] * 6 + [0.0] * 2 + [3.0] * 2 + [4.0]).expand(5, 11)
    assert torch.equal(rows, want)  # copies of exact values: no arithmetic
    assert layout.flatten([g.double() if g is not None else None for g in grads], batch_dims=1).dtype == torch.float64
    with pytest.raises(ValueError, match="at least one gradient"):
        layout.flatten([None] * 4)


def test_flatten_into_rows_of_a_given_buffer():
    """``out`` receives the rows in place; with ``index``, only the rows it names."""
    model = nn.Sequential(nn.Linear(2, 2))
    layout = ParamLayout.from_model(model)
    out = torch.full((4, layout.dim), -1.0)
    got = layout.flatten([torch.ones(2, 2, 2), None], batch_dims=1, out=out, index=torch.tensor([3, 1]))
    assert got is out
    assert torch.equal(out[[0, 2]], torch.full((2, 6), -1.0))  # untouched rows
    assert torch.equal(out[[1, 3]], torch.tensor([[1.0, 1, 1, 1, 0, 0]] * 2))
    with pytest.raises(ValueError, match="index needs batch_dims == 1"):
        layout.flatten([torch.ones(2, 2), None], out=out[0], index=torch.tensor([0]))


def test_a_work_layout_whose_slots_share_columns():
    """A projected engine's work row (``TensorSketchMap.work_slots``) may give several slots the
    same columns: its width is where the last slot ends, and ``flatten`` (one copy per slot, which
    would overwrite) refuses it."""
    shared = ParamLayout([ParamSlot("a", (4,), 0, 4), ParamSlot("b", (4,), 0, 4), ParamSlot("c", (3,), 4, 3)])
    assert shared.dim == 7 and shared.shares_columns
    with pytest.raises(ValueError, match="share columns"):
        shared.flatten([torch.ones(4), torch.ones(4), torch.ones(3)])
    plain = ParamLayout.from_model(nn.Sequential(nn.Linear(2, 2)))
    assert plain.dim == 6 and not plain.shares_columns


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_between_two_blocks_the_caller_s_requires_grad_flags_hold(engine):
    """Only the selected parameters require grad while an engine computes a block
    (``GradientEngine.computed``); between blocks, and after the caller stops early, the model is
    as the caller left it."""
    model = zoo.mlp(NUM_CLASSES, in_features=8, hidden=16)
    model[0].weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine=engine, params=["0.weight"], group_rows=2)
    blocks = eng.iter_blocks(range(NUM_CLASSES))
    seen = 0
    for _ in blocks:
        seen += 1
        assert [p.requires_grad for p in model.parameters()] == flags
        if seen == 2:
            break
    blocks.close()
    assert seen == 2 and [p.requires_grad for p in model.parameters()] == flags
