"""A layer type registered from outside with one call, its rule and how the projection structures
treat its weight (``register_rule(..., unit_shape=)``; a module-VJP unit's
``register_unit_computer(..., unit_matrices=)``): under the default projection the weight is a
TensorSketch unit sketched inside the backward, and the rows are the map of the exact rows."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers.engines import ProjectedEngine
from classgrad.workers.engines.layer_rules import RULES, register_rule
from classgrad.workers.engines.layer_rules.layer_shapes import OUTER_SHAPES
from classgrad.workers.engines.layer_rules.linear import linear_sums
from classgrad.workers.gradients import build_engine, projection_options
from tests.support.engine_cases import max_relative_error

C = 5


class Dense(nn.Module):
    """A Linear layer the engines do not know (rules match exact types)."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in) * 0.3)
        self.bias = nn.Parameter(torch.randn(fan_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@pytest.fixture
def dense_rule():
    register_rule(Dense, live_tokens=True, unit_shape=lambda m: (*m.weight.shape, False))(linear_sums)
    yield
    RULES.pop(Dense)
    OUTER_SHAPES.pop(Dense)


def test_a_layer_registered_with_its_unit_shape_is_sketched_inside_the_backward(dense_rule):
    torch.manual_seed(0)
    model = nn.Sequential(Dense(6, 12), nn.Tanh(), Dense(12, C))
    data = (torch.randn(15, 6), torch.arange(C).repeat(3))
    eng = build_engine(model, data, num_classes=C, projection=projection_options({"dim": 32, "seed": 1}))
    assert isinstance(eng, ProjectedEngine)
    assert [u.weight.name for u in eng.kmap.units] == ["0.weight", "2.weight"] and not eng.kmap.rest
    got = torch.cat([b.rows for b in eng.iter_blocks(range(C))])
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference")
    want = eng.kmap.project_full(ref.compute(range(C)).rows.double())
    # float32 rows sketched inside the backward against float64 rows sketched after.
    assert max_relative_error(got, want) < 1e-5


class Scaled(nn.Module):
    """A module with no rule (a module-VJP unit) whose weight is still a matrix to sketch."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in) * 0.3)
        self.bias = nn.Parameter(torch.randn(fan_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) @ (2 * self.weight).T + self.bias


def test_a_unit_registered_with_its_matrices_is_sketched_as_one(dense_rule):
    from classgrad.workers.engines.layer_rules.layer_shapes import UNIT_MATRICES
    from classgrad.workers.engines.layer_rules.module_vjp import (
        UNIT_COMPUTERS,
        module_class_grads,
        register_unit_computer,
    )

    register_unit_computer(Scaled, unit_matrices=lambda m: [("weight", "bias")])(module_class_grads)
    try:
        torch.manual_seed(1)
        model = nn.Sequential(Scaled(6, 12), Dense(12, C))
        data = (torch.randn(15, 6), torch.arange(C).repeat(3))
        eng = build_engine(model, data, num_classes=C, projection=projection_options({"dim": 32, "seed": 2}))
        assert [u.weight.name for u in eng.kmap.units] == ["0.weight", "1.weight"] and not eng.kmap.rest
        got = torch.cat([b.rows for b in eng.iter_blocks(range(C))])
        ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference")
        want = eng.kmap.project_full(ref.compute(range(C)).rows.double())
        # As above: float32 rows sketched in the backward against float64 rows sketched after.
        assert max_relative_error(got, want) < 1e-5
    finally:
        UNIT_COMPUTERS.pop(Scaled)
        UNIT_MATRICES.pop(Scaled)
