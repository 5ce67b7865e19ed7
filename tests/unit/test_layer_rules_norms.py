"""The norm layers' rules against the float64 reference engine: ``nn.LayerNorm``, ``nn.GroupNorm``
and ``nn.RMSNorm`` (and eval-mode BatchNorm1d/2d/3d in test_layer_rules), in fp32 and under
fp16/bf16 autocast.

A tiny model is built around the layer under test; the partitioned engine must take the hook
path with the layer's rule and give the reference engine's rows (float64 copy).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from classgrad.store.core.params import ParamSlot
from classgrad.workers import zoo
from classgrad.workers.engines.layer_rules import ClassGrid, ClassRows, LayerCapture, LayerRows, rule_for, rule_io
from tests.support.engine_cases import (
    EMPTY_CLASS,
    LOW_PRECISION_TOLERANCE,
    NUM_CLASSES,
    fell_back,
    max_relative_error,
    zero_rows,
)
from tests.support.rule_cases import Tokens, assert_hook_path, rows_and_reference

# float32 has a unit roundoff of 6e-8; these tiny models sum at most a few hundred terms per entry,
# so rows stay within a few roundoffs of the float64 reference (the engines' contract).
FP32_TOLERANCE = 1e-5
# The engines' LOW_PRECISION_TOLERANCE (engine_cases: about 20-25 unit roundoffs of the half type):
# inputs, activations and their gradients are rounded once per layer in these few-layer models.


# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


def _randomised(model: nn.Module) -> nn.Module:
    """Affine parameters away from their defaults (ones and zeros), so each matters."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)):
            for p in m.parameters():
                nn.init.uniform_(p, 0.5, 1.5)
    return model.eval()


class TwiceNorm(nn.Module):
    """One norm layer applied twice (its parameters get the sum of both calls' gradients)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.norm(x)) * 2)


def _head(features: int) -> list[nn.Module]:
    return [nn.Tanh(), nn.Flatten(), nn.Linear(features, NUM_CLASSES)]


VECTOR, IMAGE = dict(kind="vector", input_shape=(12,)), dict(kind="image", input_shape=(3, 7, 6))

CASES = {  # case -> (model, data kwargs, layer types whose rules must be used)
    "layernorm": (
        lambda: nn.Sequential(nn.Linear(12, 15), Tokens(3, 5), nn.LayerNorm(5), *_head(15)),
        VECTOR,
        {nn.LayerNorm, nn.Linear},
    ),
    "layernorm_2d_shape_no_bias": (
        lambda: nn.Sequential(Tokens(3, 2, 2), nn.LayerNorm((2, 2), eps=1e-3, bias=False), *_head(12)),
        VECTOR,
        {nn.LayerNorm, nn.Linear},
    ),
    "layernorm_called_twice": (
        lambda: nn.Sequential(nn.Linear(12, 12), Tokens(4, 3), TwiceNorm(nn.LayerNorm(3)), *_head(12)),
        VECTOR,
        {nn.LayerNorm, nn.Linear},
    ),
    "groupnorm": (
        lambda: nn.Sequential(nn.Conv2d(3, 6, 3), nn.GroupNorm(3, 6), *_head(6 * 5 * 4)),
        IMAGE,
        {nn.GroupNorm, nn.Conv2d, nn.Linear},
    ),
    "groupnorm_vector_called_twice": (
        lambda: nn.Sequential(nn.Linear(12, 8), TwiceNorm(nn.GroupNorm(2, 8, eps=1e-2)), *_head(8)),
        VECTOR,
        {nn.GroupNorm, nn.Linear},
    ),
    "groupnorm_one_group_1d": (
        lambda: nn.Sequential(Tokens(3, 4), nn.Conv1d(3, 4, 2), nn.GroupNorm(1, 4), *_head(12)),
        VECTOR,
        {nn.GroupNorm, nn.Conv1d, nn.Linear},
    ),
    "rmsnorm_default_eps": (
        lambda: nn.Sequential(nn.Linear(12, 15), Tokens(3, 5), nn.RMSNorm(5), *_head(15)),
        VECTOR,
        {nn.RMSNorm, nn.Linear},
    ),
    "rmsnorm_2d_shape_called_twice": (
        lambda: nn.Sequential(nn.Linear(12, 12), Tokens(3, 2, 2), TwiceNorm(nn.RMSNorm((2, 2), eps=1e-2)), *_head(12)),
        VECTOR,
        {nn.RMSNorm, nn.Linear},
    ),
}


def _data(data_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Imbalanced classes, one empty, one bigger than half a batch (done alone)."""
    return zoo.synthetic_probe(NUM_CLASSES, 3, imbalance=1.0, empty_classes=[EMPTY_CLASS], seed=3, **data_kwargs)


def _build(case: str) -> tuple[nn.Module, tuple, set]:
    build, data_kwargs, types = CASES[case]
    torch.manual_seed(0)
    return _randomised(build()), _data(data_kwargs), types


@pytest.mark.parametrize("route", ["cpu", "gpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_norm_rule_matches_the_float64_reference(case, route, monkeypatch):
    if route == "gpu":  # a GPU's sums by class (over the padded grid), forced on the CPU
        monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    model, data, types = _build(case)
    eng, got, ref = rows_and_reference(model, data)
    assert_hook_path(eng, types)
    assert max_relative_error(got, ref) <= FP32_TOLERANCE
    assert torch.equal(zero_rows(got), zero_rows(ref))  # the empty class, and only it


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("case", ["layernorm", "groupnorm", "rmsnorm_default_eps"])
def test_norm_rules_under_autocast(case, precision):
    """x_hat recomputed in float32 from the half input, as torch's kernels compute it."""
    model, data, types = _build(case)
    eng, got, ref = rows_and_reference(model, data, precision=precision)
    assert_hook_path(eng, types)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert max_relative_error(got, ref) <= LOW_PRECISION_TOLERANCE[precision]


@pytest.mark.parametrize(
    "case,params",
    [
        ("layernorm", ["2.bias"]),  # a norm layer's bias alone
        ("groupnorm", ["1.weight", "0.weight"]),  # its weight, and a conv's
        ("rmsnorm_default_eps", ["2.weight"]),
    ],
)
def test_norm_rules_compute_only_the_selected_parameters(case, params):
    model, data, _ = _build(case)
    eng, got, ref = rows_and_reference(model, data, params=params)
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert got.shape[1] == sum(dict(model.named_parameters())[p].numel() for p in params)
    assert max_relative_error(got, ref) <= FP32_TOLERANCE


def test_frozen_norm_parameters_are_left_out():
    model, data, _ = _build("layernorm")
    model[2].weight.requires_grad_(False)
    eng, got, ref = rows_and_reference(model, data)
    assert_hook_path(eng, {nn.LayerNorm, nn.Linear})  # the bias still is
    assert got.shape[1] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert max_relative_error(got, ref) <= FP32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "norm,scale",
    [
        (lambda: nn.LayerNorm((3, 4), eps=1e-5), 1e-3),  # variance 1e-6: eps is a tenth of it
        (lambda: nn.GroupNorm(2, 4, eps=1e-4), 1e-2),  # the same, per group
        (lambda: nn.RMSNorm((3, 4)), 3e-4),  # eps=None: float32's machine epsilon 1.2e-7 is most of mean(x^2)
    ],
    ids=["layernorm", "groupnorm", "rmsnorm_default_eps"],
)
def test_norm_rules_recompute_x_hat_with_torchs_eps_and_dims(norm, scale, dtype):
    """The rule's per-class sums against autograd on the same layer, with inputs so small that a
    wrong eps (or the wrong dimensions) would show far above the roundoff."""
    torch.manual_seed(0)
    layer = _randomised(norm()).to(dtype)
    counts = torch.tensor([3, 1, 2])
    x = scale * torch.randn(int(counts.sum()), 4, 3, 4, dtype=dtype)
    g = torch.randn_like(layer(x))
    k = len(counts)
    seen = LayerCapture(x, g, ClassGrid.of_counts(counts, dtype))
    local = seen.grid.sample_class(x.device)  # each sample's class
    params = dict(layer.named_parameters())
    slots, offset = {}, 0
    for name, p in params.items():
        slots[name] = ParamSlot(name, tuple(p.shape), offset, p.numel())
        offset += p.numel()
    run = ClassRows(torch.full((k, offset), float("nan"), dtype=dtype))
    rule_for(layer).sums(layer, seen, LayerRows(run, slots))
    assert run.certainly_finite()
    want = torch.stack(
        [
            torch.cat(
                [
                    t.flatten()
                    for t in torch.autograd.grad((layer(x[local == i]) * g[local == i]).sum(), list(params.values()))
                ]
            )
            for i in range(k)
        ]
    )
    # Sums of at most 48 products per entry, in another order than torch's kernel: a few roundoffs
    # of the dtype (a wrong eps would be off by about 10%).
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(run.rows, want, rtol=tol, atol=tol * float(want.abs().max()))
