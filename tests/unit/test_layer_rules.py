"""Each registered layer rule against the float64 reference engine, and the rule registry itself.

A tiny model is built around the layer under test; the partitioned engine must take the hook
path (the rule is what is under test) and give the reference engine's rows on a float64 copy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from classgrad.store.core.params import ParamSlot
from classgrad.workers import zoo
from classgrad.workers.engines import choices
from classgrad.workers.engines.layer_rules import (
    RULES,
    ClassGrid,
    ClassRows,
    LayerCapture,
    LayerRows,
    class_outer_sums,
    outer,
    register_rule,
    rule_for,
    rule_io,
)
from classgrad.workers.engines.layer_rules import conv as conv_module
from classgrad.workers.engines.layer_rules.conv import ConvFactors
from classgrad.workers.engines.layer_rules.hf_conv1d import TransposedLinearFactors
from classgrad.workers.engines.layer_rules.linear import LinearFactors
from classgrad.workers.engines.layer_rules.rule_io import Ragged, live_tokens
from classgrad.workers.gradients import build_engine, projection_options
from classgrad.workers.projection import SketchUnit
from tests.support.docs import python_blocks
from tests.support.engine_cases import EMPTY_CLASS, NUM_CLASSES, fell_back, max_relative_error, zero_rows
from tests.support.rule_cases import Scale, Tokens, assert_hook_path, rows_and_reference

LAYERS_DOC = Path(__file__).resolve().parents[2] / "docs" / "layers.md"


# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


def _randomised(model: nn.Module) -> nn.Module:
    """Eval mode, with running statistics and affine parameters away from their defaults (so
    ``x_hat`` differs from ``x`` and every parameter matters)."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model.eval()


def _conv_head(*body: nn.Module, channels: int, dims: int = 2) -> nn.Sequential:
    pool = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}[dims](2)
    return nn.Sequential(*body, nn.ReLU(), pool, nn.Flatten(), nn.Linear(2**dims * channels, NUM_CLASSES))


def _build(case: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    image, vector = dict(kind="image", input_shape=(3, 9, 9)), dict(kind="vector", input_shape=(8,))
    signal, volume = dict(kind="image", input_shape=(3, 11)), dict(kind="image", input_shape=(2, 5, 6, 7))
    models = {
        "linear": (lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, NUM_CLASSES)), vector),
        "linear_no_bias": (
            lambda: nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, NUM_CLASSES, bias=False)),
            vector,
        ),
        "linear_positions": (
            lambda: nn.Sequential(Tokens(2, 4), nn.Linear(4, 6), nn.Tanh(), nn.Flatten(), nn.Linear(12, NUM_CLASSES)),
            vector,
        ),
        "linear_last_position": (
            lambda: nn.Sequential(Tokens(3, 4), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, NUM_CLASSES), LastPosition()),
            dict(kind="vector", input_shape=(12,)),
        ),
        "conv": (lambda: _conv_head(nn.Conv2d(3, 4, 3), channels=4), image),
        "conv_no_bias": (lambda: _conv_head(nn.Conv2d(3, 4, 3, bias=False), channels=4), image),
        "conv_strided": (
            lambda: _conv_head(nn.Conv2d(3, 4, 3, stride=2, padding=(2, 1), dilation=2), channels=4),
            image,
        ),
        "conv_grouped": (
            lambda: _conv_head(
                nn.Conv2d(3, 6, 1),
                nn.Conv2d(6, 4, 3, groups=2, padding=1),
                nn.Conv2d(4, 4, 3, groups=4, stride=2),
                channels=4,
            ),
            image,
        ),
        "conv_pointwise": (  # a 1x1 convolution at 16 positions: the patches are a strided view
            lambda: _conv_head(nn.Conv2d(3, 4, 3, stride=2), nn.Conv2d(4, 4, 1), channels=4),
            image,
        ),
        "conv1d": (
            lambda: _conv_head(
                nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2),
                nn.Conv1d(4, 4, 3, groups=2, bias=False),
                channels=4,
                dims=1,
            ),
            signal,
        ),
        "conv3d": (
            lambda: _conv_head(
                nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 1), padding=(1, 0, 2), dilation=(1, 1, 2)),
                nn.Conv3d(4, 4, 1, groups=4),
                channels=4,
                dims=3,
            ),
            volume,
        ),
        "batchnorm3d": (lambda: _conv_head(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4), channels=4, dims=3), volume),
        "batchnorm1d": (
            lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, NUM_CLASSES)),
            vector,
        ),
        "batchnorm1d_positions": (
            lambda: nn.Sequential(Tokens(2, 4), nn.BatchNorm1d(2), nn.Tanh(), nn.Flatten(), nn.Linear(8, NUM_CLASSES)),
            vector,
        ),
        "batchnorm2d": (lambda: _conv_head(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), channels=4), image),
    }
    build, data_kwargs = models[case]
    return _randomised(build()), data_kwargs


def _data(data_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Imbalanced classes, one empty, one bigger than half a batch (done alone)."""
    return zoo.synthetic_probe(NUM_CLASSES, 3, imbalance=1.0, empty_classes=[EMPTY_CLASS], seed=3, **data_kwargs)


def _rows(model: nn.Module, data, params=None):
    """(engine, its rows, the float64 reference engine's rows)."""
    return rows_and_reference(model, data, params=params)


RULE_CASES = {  # case -> the layer types whose rule must be used
    "linear": {nn.Linear},
    "linear_no_bias": {nn.Linear},
    "linear_positions": {nn.Linear},
    "linear_last_position": {nn.Linear},
    "conv": {nn.Conv2d, nn.Linear},
    "conv_no_bias": {nn.Conv2d, nn.Linear},
    "conv_strided": {nn.Conv2d, nn.Linear},
    "conv_grouped": {nn.Conv2d, nn.Linear},
    "conv_pointwise": {nn.Conv2d, nn.Linear},
    "conv1d": {nn.Conv1d, nn.Linear},
    "conv3d": {nn.Conv3d, nn.Linear},
    "batchnorm3d": {nn.BatchNorm3d, nn.Conv3d, nn.Linear},
    "batchnorm1d": {nn.BatchNorm1d, nn.Linear},
    "batchnorm1d_positions": {nn.BatchNorm1d, nn.Linear},
    "batchnorm2d": {nn.BatchNorm2d, nn.Conv2d, nn.Linear},
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_each_rule_matches_the_float64_reference(case):
    model, data_kwargs = _build(case)
    eng, got, ref = _rows(model, _data(data_kwargs))
    # The hook path itself is under test: no fallback to vmap, and the spot check passed.
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert {r.module_type for r in eng._hooked.plan.rules.values()} == RULE_CASES[case]
    # float32 has a unit roundoff of 6e-8; these tiny models sum at most a few hundred terms per
    # entry, so the normwise error stays within a few roundoffs (the engines' contract, as in
    # test_engines).
    assert max_relative_error(got, ref) <= 1e-6
    assert torch.equal(zero_rows(got), zero_rows(ref))  # the empty class, and only it


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_the_gpu_routes_match_the_float64_reference(case, monkeypatch):
    """The routes a GPU takes, forced on the CPU: outer sums as one batched product over the
    zero-padded grid, sums by class over it (the CPU's routes: a product per class on unpadded
    tokens, one indexed add; they are what every other test here runs)."""
    taken = []
    real = outer._ragged_sums
    monkeypatch.setattr(outer, "_ragged_sums", lambda *a: taken.append(1) or real(*a))
    monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    model, data_kwargs = _build(case)
    eng, got, ref = _rows(model, _data(data_kwargs))
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert not taken
    assert max_relative_error(got, ref) <= 1e-6  # as in test_each_rule_matches_the_float64_reference
    assert torch.equal(zero_rows(got), zero_rows(ref))


def test_the_cpu_takes_one_product_per_class_when_classes_differ_in_size(monkeypatch):
    taken = []
    real = outer._ragged_sums
    monkeypatch.setattr(outer, "_ragged_sums", lambda *a: taken.append(1) or real(*a))
    model, data_kwargs = _build("linear_positions")
    _rows(model, _data(data_kwargs))
    assert taken


@pytest.mark.parametrize(
    "case,params",
    [
        ("conv", ["0.bias"]),  # a conv's bias alone
        ("batchnorm2d", ["1.weight"]),  # a norm layer's weight alone
        ("linear", ["2.bias", "0.weight"]),  # a weight in one layer, a bias in another
    ],
)
def test_rules_compute_only_the_selected_parameters(case, params):
    model, data_kwargs = _build(case)
    eng, got, ref = _rows(model, _data(data_kwargs), params=params)
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert got.shape == ref.shape and got.shape[1] < sum(p.numel() for p in model.parameters())
    # Same contract as above: a few float32 roundoffs.
    assert max_relative_error(got, ref) <= 1e-6


@pytest.mark.parametrize(
    "dims,groups,stride,dilation,padding",
    [
        (2, 1, 1, 1, 0),
        (2, 2, 2, 1, 1),
        (2, 3, 1, 2, (2, 0)),
        (1, 1, 2, 2, 1),
        (1, 3, 1, 1, 0),
        (3, 1, (1, 2, 1), (2, 1, 1), (1, 0, 2)),
        (3, 2, 1, 1, 0),
    ],
)
def test_conv_token_factors_give_the_grouped_kernels_sums(dims, groups, stride, dilation, padding):
    """The convolution rule's outer-product factors (what a projection inside the backward will
    use) and each of its fast kernels (a grouped convolution backward in either layout, one per class
    size, one per class) give the same per-class sums."""
    torch.manual_seed(0)
    conv_type = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    conv = conv_type(6, 3 * groups, 3, stride=stride, dilation=dilation, padding=padding, groups=groups).double()
    x = torch.randn(6, 6, *(7, 8, 9)[:dims], dtype=torch.float64)
    counts = torch.tensor([3, 1, 0, 2])  # an empty class too
    g = torch.randn_like(conv(x))
    k = len(counts)
    seen = LayerCapture(x, g, ClassGrid.of_counts(counts, torch.float64))
    local = seen.grid.sample_class(x.device)  # each sample's class
    slots = {
        "weight": ParamSlot("weight", tuple(conv.weight.shape), 0, conv.weight.numel()),
        "bias": ParamSlot("bias", tuple(conv.bias.shape), conv.weight.numel(), conv.bias.numel()),
    }
    dim = conv.weight.numel() + conv.bias.numel()

    class Route(ConvFactors):
        """Every route of the rule forced: the timed choice, the grouped backward in either
        layout, a plain backward per class, or the tokens (no direct kernel)."""

        route = "timed"

        def direct_sums(self, want_weight: bool, want_bias: bool):
            if self.route == "timed":
                return super().direct_sums(want_weight, want_bias)
            if self.route == "by_size":
                return self._by_size(want_weight, want_bias)
            if self.route == "per_class":
                return self._per_class(want_weight, want_bias)
            if self.route == "tokens":
                return None
            return self._grouped(self.route, self.G, self.A, want_weight, want_bias)

    results = []
    for route in ("timed", "contiguous", "channels_last", "by_size", "per_class", "tokens"):
        factors = Route(conv, seen)
        factors.route = route
        run = ClassRows(torch.full((k, dim), float("nan"), dtype=torch.float64))
        class_outer_sums(factors, LayerRows(run, slots))
        assert run.certainly_finite()
        results.append(run.rows)
    want = torch.stack(
        [
            torch.cat(
                [
                    t.flatten()
                    for t in torch.autograd.grad((conv(x[local == i]) * g[local == i]).sum(), [conv.weight, conv.bias])
                ]
            )
            for i in range(k)
        ]
    )
    # float64 sums of at most a few hundred products of O(1) numbers, in different orders.
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "side,channels,counts,route",
    [
        (4, 2, [2, 2], "tokens"),
        (4, 2, [3, 1], "tokens"),
        (8, 2, [3, 1], "by_size"),
        (32, 64, [3, 1], "per_class"),  # 1,024 positions x 576 x 64: past SMALL_WORK
        (8, 2, [2, 2], "contiguous"),
    ],
)
def test_the_conv_kernel_is_a_rule_of_positions_and_class_sizes(side, channels, counts, route):
    """On a CPU: few output positions per sample (16 here) -> patches and one batched product;
    more, with classes of unequal size -> a grouped backward per class size for a small layer, a
    backward per class for a larger one; equal sizes -> one grouped one."""
    conv = nn.Conv2d(channels, channels + 1, 3, padding=1)
    x = torch.randn(sum(counts), channels, side, side)
    with torch.no_grad():
        g = torch.randn_like(conv(x))
    grid = ClassGrid.of_counts(torch.tensor(counts), torch.float32)
    assert (grid.spots is None) == (counts[0] == counts[1])  # equal classes: the plain grid
    assert conv_module.conv_route(conv, LayerCapture(x, g, grid)) == route


@pytest.mark.parametrize(
    "counts",
    [
        [1] * 12 + [2] * 5,  # ordered by size: views, padded with the next samples or, for 2, the ones before
        [2, 1, 1, 3, 1, 2, 1, 1, 1, 1, 1, 1],  # not ordered: gathers, padded with the last class again
    ],
)
@pytest.mark.parametrize("side,fmt", [(8, "contiguous"), (32, "contiguous"), (32, "channels_last")])
def test_by_size_sums_each_class_from_views_or_gathers(counts, side, fmt):
    """``ConvFactors._by_size`` (a grouped backward per class size, group counts padded to
    ``GROUPS_STEP``) against each class's own backward, with its samples taken as views of the
    run's (classes of a size adjacent) or gathered, in the layout ``by_size_layout`` picks."""
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    memory = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
    x = torch.randn(sum(counts), 2, side, side, dtype=torch.float64).contiguous(memory_format=memory)
    with torch.no_grad():
        g = torch.randn_like(conv(x)).contiguous(memory_format=memory)
    seen = LayerCapture(x, g, ClassGrid.of_counts(torch.tensor(counts), torch.float64))
    want_layout = (
        "channels_last" if fmt == "channels_last" and side * side >= conv_module.LAYOUT_POSITIONS else "contiguous"
    )
    assert conv_module.by_size_layout(x, g) == want_layout
    gw, gb = ConvFactors(conv, seen)._by_size(True, True)
    local = seen.grid.sample_class(x.device)
    for i in range(len(counts)):
        w, b = torch.autograd.grad((conv(x[local == i]) * g[local == i]).sum(), [conv.weight, conv.bias])
        # float64 sums over a few samples' positions, in different orders.
        torch.testing.assert_close(gw[i], w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gb[i], b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("counts", [[2, 2], [3, 0, 1]])  # the plain grid, and one with padding
@pytest.mark.parametrize(
    "layer,token_shape",
    [
        (nn.Linear(5, 3), ()),
        (nn.Linear(5, 3), (4, 2)),  # tokens per sample: every dimension between batch and features
        (nn.Conv2d(4, 6, 3, stride=2, padding=1), (9, 9)),
        (nn.Conv1d(4, 6, 3, groups=2), (11,)),
    ],
)
def test_grid_tokens_count_the_formed_tokens_from_shapes(layer, token_shape, counts):
    """``grid_tokens`` is what a sketch's route is chosen by, before any token is formed (a
    convolution's exact kernel never forms them): the count of ``grad_tokens()``'s token rows."""
    n = sum(counts)
    if isinstance(layer, nn.Linear):
        x = torch.randn(n, *token_shape, 5)
        kinds = [LinearFactors, TransposedLinearFactors]
    else:
        x = torch.randn(n, 4, *token_shape)
        kinds = [ConvFactors]
    with torch.no_grad():
        g = torch.randn_like(layer(x))
    seen = LayerCapture(x, g, ClassGrid.of_counts(torch.tensor(counts), torch.float32))
    for kind in kinds:
        factors = kind(layer, seen) if kind is ConvFactors else kind(seen)
        tokens = factors.grad_tokens()
        assert factors.grid_tokens() == tokens.shape[0] * tokens.shape[1]


@pytest.mark.parametrize(
    "conv",
    [nn.Conv2d(3, 2, 7, stride=2, padding=3), nn.Conv2d(4, 2, 3, padding=1, dilation=2), nn.Conv2d(5, 2, (1, 3))],
)
def test_patches_are_im2col_token_major(conv):
    x = torch.randn(3, conv.in_channels, 9, 8)
    want = torch.nn.functional.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    # The same entries moved into place, no arithmetic: exact.
    assert torch.equal(conv_module.patches(x, conv), want.transpose(1, 2))


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 2, 7, stride=2, padding=3),
        nn.Conv2d(4, 2, 3, padding=1, dilation=2, bias=False),
        nn.Conv2d(5, 2, (1, 3)),
        nn.Conv1d(3, 2, 3, padding=2, stride=2),
        nn.Conv3d(2, 2, (2, 3, 1), padding=(1, 0, 0)),
    ],
)
def test_channels_inner_patches_are_the_patches_in_the_sketch_units_column_order(conv):
    x = torch.randn(3, conv.in_channels, *[7, 9, 5][: conv.weight.dim() - 2])
    unit = SketchUnit(0, ParamSlot("w", (1,), 0, 1), None, conv.out_channels, conv.weight[0].numel(), False, 8, 1, 0)
    order = unit.column_order(conv.in_channels)
    # The same entries moved, no arithmetic: exact. Column j of the new order is M's column order[j].
    assert torch.equal(conv_module.patches_channels_inner(x, conv), conv_module.patches(x, conv)[:, :, order])


def test_per_class_products_of_ragged_tokens_match_one_product_per_class():
    tokens = [6, 0, 3, 6, 9, 3]  # token counts repeat (one batched product each), an empty class
    first, second = torch.randn(sum(tokens), 4, dtype=torch.float64), torch.randn(sum(tokens), 5, dtype=torch.float64)
    out = torch.full((len(tokens), 4, 5), float("nan"), dtype=torch.float64)
    Ragged(first, second, tokens, 3).per_class_mm(first, second, out)
    start = 0
    for i, n in enumerate(tokens):
        want = first[start : start + n].t() @ second[start : start + n]
        # float64 products of the same terms, batched or not: 1e-12 relative.
        torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        start += n


class LastPosition(nn.Module):
    """``[N, T, C]`` -> ``[N, C]``: the last position's scores (a decoder's classifier head scores
    every position and keeps one, so the head's gradient is zero at the others)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("imbalance", [0.0, 1.0])
def test_tokens_with_a_zero_gradient_are_left_out_of_the_sums_exactly(projected, imbalance, monkeypatch):
    kept = []
    real = Ragged.keeping
    monkeypatch.setattr(
        Ragged, "keeping", lambda self, live: kept.append((len(live), int(live.sum()))) or real(self, live)
    )
    model, data_kwargs = _build("linear_last_position")
    data = zoo.synthetic_probe(NUM_CLASSES, 3, imbalance=imbalance, empty_classes=[EMPTY_CLASS], seed=3, **data_kwargs)
    proj = projection_options({"dim": 16, "seed": 2}) if projected else None
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine="partitioned", batch_size=12, projection=proj)
    got = eng.compute(range(NUM_CLASSES)).rows
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=NUM_CLASSES, engine="reference")
    want = ref.compute(range(NUM_CLASSES)).rows
    want = eng.kmap.project_full(want) if projected else want
    assert not fell_back(eng), eng.stats.notes
    # Only the head's tokens: one of the 3 positions of every sample is live (the body's are all).
    assert kept and all(live * 3 == tokens for tokens, live in kept)
    # float32 against float64, sums of a few terms: as in test_each_rule_matches_the_float64_reference
    # (the sketch adds its products and FFTs: 1e-5, as in test_tensor_sketch).
    assert max_relative_error(got, want) <= (1e-5 if projected else 1e-6)
    assert torch.equal(zero_rows(got), zero_rows(want))


def test_live_tokens_are_the_rows_not_all_zero():
    g = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, -2.0], [3.0, 4.0]])
    assert torch.equal(live_tokens(g), torch.tensor([True, False, True, True]))
    assert live_tokens(g[[0, 2, 3]]) is None  # every row live (one starts with a zero)
    assert live_tokens(g[[0, 3]]) is None  # no row starts with a zero: not read further
    assert live_tokens(g[:0]) is None


def _scale_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Scale(8), nn.Tanh(), nn.Linear(8, NUM_CLASSES)).eval()


@pytest.fixture
def scale_rule():
    """Registers ``register(sums)`` as the rule for ``Scale`` for one test; the calls it got."""
    calls: list[int] = []

    def register(factor: float = 1.0) -> list[int]:
        @register_rule(Scale)
        def scale_sums(module: Scale, seen: LayerCapture, out: LayerRows) -> None:
            calls.append(seen.k)
            G = seen.grads_by_class()
            gw = factor * (G * seen.inputs_by_class()).sum(dim=1) if out.wants("weight") else None
            gb = G.sum(dim=1) if out.wants("bias") else None
            out.bound_by_values(gw, gb)
            for kind, value in (("weight", gw), ("bias", gb)):
                if value is not None:
                    out.put(kind, value)

        return calls

    yield register
    RULES.pop(Scale, None)


def test_a_user_registered_rule_is_used(scale_rule):
    model = _scale_model()
    data = _data(dict(kind="vector", input_shape=(8,)))
    eng, _, _ = _rows(model, data)
    # No rule for Scale: its module's VJP (layer_rules.module_vjp), the Linear layers by their rule.
    assert eng._hooked is not None and set(eng._hooked.plan.units) == {model[1]}
    calls = scale_rule()
    eng, got, ref = _rows(model, data)
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert not eng._hooked.plan.units and model[1] in eng._hooked.plan.rules
    assert calls and rule_for(model[1]).sums.__name__ == "scale_sums"
    # A few float32 roundoffs, as for the built-in rules.
    assert max_relative_error(got, ref) <= 1e-6


def test_a_wrong_user_rule_is_caught_by_the_spot_check(scale_rule):
    """The first run's check against the plain single-class path holds for every rule: a rule
    that gets its sums wrong is abandoned for vmap, and the rows are still exact."""
    scale_rule(factor=2.0)
    eng, got, ref = _rows(_scale_model(), _data(dict(kind="vector", input_shape=(8,))))
    assert eng._hooked is None
    assert any("differ from the plain gradient" in note for note in eng.stats.notes), eng.stats.notes
    # The vmap rows: a few float32 roundoffs, as above.
    assert max_relative_error(got, ref) <= 1e-6


@pytest.mark.parametrize(
    "conv", [nn.Conv1d(3, 4, 3, padding="same"), nn.Conv3d(3, 4, 3, padding=1, padding_mode="reflect")]
)
def test_a_refused_convolution_says_why_and_stays_exact(conv):
    assert "padding" in (rule_for(conv).applies(conv) or "")
    dims = conv.weight.dim() - 2
    model = _randomised(_conv_head(conv, channels=4, dims=dims))
    data = _data(dict(kind="image", input_shape=(3, 7, 6, 5)[: dims + 1]))
    eng, got, ref = _rows(model, data)
    # Not by its rule: its own module VJP computed its rows (the path line says why).
    assert eng._hooked is not None and conv in eng._hooked.plan.units, eng.stats.notes
    assert any("not by its rule (padding" in note for note in eng.stats.notes), eng.stats.notes
    # Same contract as the rules: a few float32 roundoffs.
    assert max_relative_error(got, ref) <= 1e-6


def test_the_docs_example_rule_runs_as_written_and_is_exact():
    """docs/layers.md's ``register_rule`` example, executed as written, on a model with the
    example layer at several positions per sample."""
    blocks = python_blocks(LAYERS_DOC.read_text())
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/layers.md", "exec"), namespace)  # noqa: S102 - the doc's own example
    layer_type = namespace["FeatureScale"]
    try:
        assert rule_for(layer_type(3)).sums is namespace["feature_scale_sums"]
        torch.manual_seed(0)
        scale = layer_type(4)
        nn.init.uniform_(scale.weight, 0.5, 1.5)
        nn.init.uniform_(scale.bias, -0.5, 0.5)
        model = nn.Sequential(
            nn.Linear(8, 12), Tokens(3, 4), scale, nn.Tanh(), nn.Flatten(), nn.Linear(12, NUM_CLASSES)
        )
        eng, got, ref = _rows(model.eval(), _data(dict(kind="vector", input_shape=(8,))))
        assert_hook_path(eng, {layer_type, nn.Linear})
        # A few float32 roundoffs, as for the built-in rules.
        assert max_relative_error(got, ref) <= 1e-6
    finally:
        RULES.pop(layer_type, None)


def test_the_registry_refuses_a_second_rule_and_matches_exact_types():
    with pytest.raises(ValueError, match="already registered"):
        register_rule(nn.Linear)(lambda module, seen, out: None)
    with pytest.raises(TypeError):
        register_rule(int)

    class MyLinear(nn.Linear):  # a subclass may change forward: no rule unless registered
        pass

    assert rule_for(nn.Linear(2, 2)) is RULES[nn.Linear]
    assert rule_for(MyLinear(2, 2)) is None
    assert rule_for(nn.BatchNorm2d(2).train()).applies(nn.BatchNorm2d(2).train()) is not None
    assert rule_for(nn.Conv2d(2, 2, 3, padding="same")).applies(nn.Conv2d(2, 2, 3, padding="same")) is not None


def test_choices_clear_forgets_every_choice():
    model = nn.Linear(2, 2)
    choices.BLOCK_ROWS[("a",)] = 4
    choices.HOOKS_CHECKED[model] = {("a",)}
    choices.VMAP_REFUSED[model] = "why"
    choices.clear()
    assert not choices.BLOCK_ROWS and model not in choices.HOOKS_CHECKED and model not in choices.VMAP_REFUSED


def test_rows_scaled_after_their_sums_keep_their_finiteness_evidence():
    """``ClassRows.scale_rows``: each row times its factor, and every bound by the largest one,
    so ``certainly_finite`` still covers the scaled rows."""
    for factors, certain in ((torch.tensor([1.0, 2.0]), True), (torch.tensor([1.0, 100.0]), False)):
        run = ClassRows(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        run.bounds.append(torch.tensor(1e29))  # below FINITE_BOUND (1e30) until scaled past it
        run.scale_rows(factors)
        assert torch.equal(run.rows, torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * factors.unsqueeze(1))
        assert bool(run.certainly_finite()) == certain
