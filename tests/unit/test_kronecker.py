"""Kronecker-structured projection inside the backward (``projection.structure: kronecker``).

Rows from the hook path against the same factors applied to the float64 reference engine's full
rows; the factors (reproducible, unbiased); the exact split of ``projection.dim``; a job's store
against ``per_class_gradients``, with what the store records, ``inspect``, ``verify`` and
``similarity``; and the one-line refusals where rows would not come from the hook path.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from classgrad.config import JobConfig
from classgrad.errors import ConfigError
from classgrad.service.analysis.inspect import format_report, inspect_store
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.analysis.verify import verify_store
from classgrad.service.driver_runtime.preparation import recorded_projection
from classgrad.store import open_store
from classgrad.store.core.params import ParamSlot
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import build_engine, per_class_gradients, projection_options
from classgrad.workers.projection import Projector
from classgrad.workers.projection.kronecker.kronecker_map import GROUP_BASE, KroneckerUnit, allocate, kronecker_factor
from tests.support.devices import needs_cuda
from tests.support.engine_cases import max_relative_error
from tests.support.jobs import MLP_JOB_CLASSES, mlp_job, run_without_ray

C = 6
JOB_C = MLP_JOB_CLASSES


# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


class Seq(nn.Module):
    """``[N, 12]`` -> ``[N, 3, 4]`` tokens through a Linear (a sum over positions), then a head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 10)
        self.b = nn.Linear(10, 8, bias=False)
        self.head = nn.Linear(24, C)

    def forward(self, x):
        h = torch.tanh(self.a(x.view(-1, 3, 4)))
        return self.head(torch.relu(self.b(h)).flatten(1))


def conv_bn():
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1, stride=2),
        nn.BatchNorm2d(5),
        nn.ReLU(),
        nn.Conv2d(5, 6, 2, dilation=2),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, C),
    )
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
    return model.eval()


def data(shape, n=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C - 1, (n,), generator=g)  # class C - 1 has no samples: a zero row
    y[:7] = 0  # one class bigger than half a batch: done alone
    return torch.randn(n, *shape, generator=g), y


def grouped():
    """A depthwise convolution between two plain ones: no Kronecker structure, so it joins the rest."""
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 1),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, C),
    ).eval()


class Gate(nn.Module):
    """A raw parameter used in the module's own forward: no layer rule, a module-VJP unit."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class NormUnits(nn.Module):
    """Tokens through a Linear (Kronecker), a LayerNorm (its rule) and a Gate (a unit): the rest
    is computed by a rule and a unit alongside the projected layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 10)
        self.norm = nn.LayerNorm(10)
        self.gate = Gate(10)
        self.head = nn.Linear(30, C)

    def forward(self, x):
        h = self.gate(self.norm(torch.tanh(self.a(x.view(-1, 3, 4)))))
        return self.head(torch.tanh(h).flatten(1))


class Conv1d3d(nn.Module):
    """A Conv3d, then its output's channels and depth as the channels of a Conv1d."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.c3 = nn.Conv3d(3, 4, 2, padding=(1, 0, 0), stride=(2, 1, 1))
        self.c1 = nn.Conv1d(12, 5, 3, dilation=2)
        self.head = nn.Linear(5 * 5, C)

    def forward(self, x):
        h = torch.tanh(self.c3(x))  # [N, 4, 3, 3, 3]
        h = torch.tanh(self.c1(h.reshape(len(x), 12, 9)))  # [N, 5, 5]
        return self.head(h.flatten(1))


# rest kept whole, plus 40-50 projected columns
KEEP_DIM = {"tokens": 200, "conv_bn": 200, "grouped": 720, "norm_units": 256, "conv1d_3d": 200}
CASES = {
    "tokens": (lambda: (torch.manual_seed(1), Seq())[1].eval(), (12,)),
    "conv_bn": (conv_bn, (3, 8, 8)),
    "grouped": (grouped, (3, 5, 5)),
    "norm_units": (lambda: (torch.manual_seed(2), NormUnits())[1].eval(), (12,)),
    "conv1d_3d": (lambda: Conv1d3d().eval(), (3, 4, 4, 4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rest", ["dense", "keep", "sketch"])
@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_rows_equal_factors_applied_to_the_float64_reference(case, rest, kind):
    make, shape = CASES[case]
    model, (x, y) = make(), data(shape)
    proj = {
        "structure": "kronecker",
        "dim": KEEP_DIM[case] if rest == "keep" else 40,
        "seed": 5,
        "kind": kind,
        "rest": rest,
    }
    eng = build_engine(model, (x, y), num_classes=C, batch_size=12, projection=projection_options(proj))
    assert eng._hooked is not None and eng.kmap.units, "the hook path projects the rows"
    got = eng.compute(range(C)).rows
    ref = build_engine(copy.deepcopy(model).double(), (x.double(), y), num_classes=C, engine="reference")
    want = eng.kmap.project_full(ref.compute(range(C)).rows)
    assert got.shape == (C, proj["dim"]) and want.dtype == torch.float64
    # fp32 sums of products in another order than the float64 reference: 1e-5 relative.
    assert max_relative_error(got, want) <= 1e-5
    assert bool((got[C - 1] == 0).all())  # the empty class
    # The Python API gives the same rows; the image memory format is chosen by timing
    # (ImageFormat), which may change float32 summation order: 1e-5 relative.
    api = per_class_gradients(model, (x, y), num_classes=C, batch_size=12, projection=proj)
    assert max_relative_error(api, got) <= 1e-5
    # The head sees one token per sample (low_rank: dense): it joins the rest, like BatchNorm.
    described = eng.describe()
    if case == "conv_bn":
        assert described["rest_params"] == ["1.weight", "1.bias", "5.weight", "5.bias"]
        assert [u["param"] for u in described["units"]] == ["0.weight", "3.weight"]
    elif case == "grouped":
        assert described["rest_params"] == ["2.weight", "2.bias", "6.weight", "6.bias"]
        assert [u["param"] for u in described["units"]] == ["0.weight", "4.weight"]
    elif case == "conv1d_3d":  # Conv3d and Conv1d projected like Conv2d: one convolution per factor
        assert described["rest_params"] == ["head.weight", "head.bias"]
        assert [u["param"] for u in described["units"]] == ["c3.weight", "c1.weight"]
    elif case == "norm_units":  # the LayerNorm's rule and the Gate's unit fill the rest
        assert described["rest_params"] == ["norm.weight", "norm.bias", "gate.scale", "head.weight", "head.bias"]
        assert [(u["param"], u["tokens_per_sample"]) for u in described["units"]] == [("a.weight", 3)]
        assert eng._hooked.plan.units and eng._hooked.plan.rules
    else:
        assert described["dense_layers"] == ["head"]
        assert [(u["param"], u["tokens_per_sample"]) for u in described["units"]] == [("a.weight", 3), ("b.weight", 3)]


@pytest.mark.parametrize("case", ["tokens", "norm_units"])
def test_the_gpu_route_of_the_projected_sums_equals_the_reference(case, monkeypatch):
    """The padded grid a GPU takes (the CPU projects unpadded tokens, as every other test here
    runs), forced on the CPU; classes of unequal size."""
    from classgrad.workers.engines.layer_rules import rule_io

    monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    make, shape = CASES[case]
    model, (x, y) = make(), data(shape)
    proj = {"structure": "kronecker", "dim": 40, "seed": 5}
    eng = build_engine(model, (x, y), num_classes=C, batch_size=12, projection=projection_options(proj))
    got = eng.compute(range(C)).rows
    ref = build_engine(copy.deepcopy(model).double(), (x.double(), y), num_classes=C, engine="reference")
    # fp32 sums of products in another order than the float64 reference: 1e-5 relative.
    assert max_relative_error(got, eng.kmap.project_full(ref.compute(range(C)).rows)) <= 1e-5


def test_factors_are_reproducible_and_scaled():
    a = kronecker_factor("rademacher", 9, GROUP_BASE + 4, 300, 16)
    assert torch.equal(a, kronecker_factor("rademacher", 9, GROUP_BASE + 4, 300, 16))
    assert torch.equal(a.abs(), torch.full_like(a, 0.25))  # +-1/sqrt(16)
    assert not torch.equal(a, kronecker_factor("rademacher", 9, GROUP_BASE + 5, 300, 16))
    # The first rows of a longer factor are the shorter one (a pure function of row and column).
    assert torch.equal(kronecker_factor("gaussian", 1, 7, 50, 8), kronecker_factor("gaussian", 1, 7, 80, 8)[:50])
    g = kronecker_factor("gaussian", 1, 7, 4000, 8)
    # 32,000 entries of variance 1/8: the sample variance is within 3% with overwhelming probability.
    assert abs(float(g.var()) * 8 - 1) < 0.03


@needs_cuda
@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_factors_same_on_cuda(kind):
    cpu = kronecker_factor(kind, 3, GROUP_BASE + 1, 777, 24)
    assert torch.equal(cpu, kronecker_factor(kind, 3, GROUP_BASE + 1, 777, 24, "cuda").cpu())


def test_inner_products_preserved_in_expectation():
    torch.manual_seed(0)
    x, y = torch.randn(2, 12, 9, dtype=torch.float64).unbind(0)
    y = y + 0.5 * x  # correlated, so the inner product is far from zero
    slot = ParamSlot("w", (12, 9), 0, 108)
    est = []
    for seed in range(400):
        u = KroneckerUnit(0, slot, None, 12, 9, k_out=3, k_in=3, seed=seed)
        px, py = u.project_matrix(None, torch.stack([x.flatten(), y.flatten()]))
        est.append(float(px @ py))
    truth = float((x * y).sum())
    # 400 independent estimates: the mean is within 4 standard errors of the truth.
    assert abs(np.mean(est) - truth) < 4 * np.std(est) / np.sqrt(len(est))


@pytest.mark.parametrize("dim", [9, 50, 97, 211, 300])
@pytest.mark.parametrize("rest", [("dense", 30), ("keep", 5), ("dense", 0)])
def test_allocation_is_exactly_dim(dim, rest):
    mode, rest_size = rest
    shapes = [(16, 33), (8, 9), (5, 17)]
    units = [KroneckerUnit(i, ParamSlot(f"l{i}.weight", s, 0, s[0] * s[1]), None, *s) for i, s in enumerate(shapes)]
    weights = [4.0, 1.0, 0.5, 2.0]
    rest_width = allocate(units, dim, rest_size, mode, weights)
    assert sum(u.width for u in units) + rest_width == dim
    assert all(1 <= u.k_out <= u.a and 1 <= u.k_in <= u.cols_in for u in units)
    if dim >= 97 and mode == "dense" and rest_size == 0:
        assert units[0].width > units[1].width > units[2].width  # more norm, more columns


def test_allocation_refuses_impossible_dims():
    unit = KroneckerUnit(0, ParamSlot("w", (4, 4), 0, 16), None, 4, 4)
    with pytest.raises(ConfigError, match="larger than the row"):
        allocate([unit], 40, 10, "dense", [1.0, 1.0])
    with pytest.raises(ConfigError, match="raise projection.dim"):
        allocate([unit], 10, 10, "keep", [1.0, 1.0])


def test_job_store_matches_python_api_and_is_inspected_verified_compared(tmp_path):
    # An MLP's layers all see one token per sample: low_rank=kronecker keeps them Kronecker here.
    proj = {"structure": "kronecker", "dim": 48, "seed": 3, "kind": "gaussian", "low_rank": "kronecker"}
    config = mlp_job(tmp_path, projection=proj)
    store = run_without_ray(config)
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    api = per_class_gradients(model, probe, num_classes=store.num_classes, projection=proj)
    # Same engine, same factors, same split (recorded by the driver, reused by the worker);
    # only how classes are grouped into runs differs (shards of 8): float32 summation order.
    np.testing.assert_allclose(store.rows(np.arange(store.num_classes)), api.numpy(), rtol=1e-5, atol=1e-7)
    info = store.attrs["projection"]
    assert info["structure"] == "kronecker" and info["out_dim"] == store.dim == 48
    assert [u["param"] for u in info["units"]] == ["0.weight", "2.weight", "4.weight"]
    assert all(u["measured_sq_norm"] > 0 and u["factor_shapes"][1][1] == u["shape"][1] + 1 for u in info["units"])
    report = format_report(inspect_store(store))
    assert "kronecker (gaussian, seed 3, split by norm)" in report
    assert "4.weight" in report and "->" in report
    assert verify_store(config.store.url).code == 0
    # A resume reuses the recorded split (no new measurement), and finds every shard done.
    assert recorded_projection(config) == info
    assert (
        recorded_projection(config.model_copy(update={"store": config.store.model_copy(update={"overwrite": True})}))
        is None
    )
    assert run_without_ray(config).attrs["projection"] == info
    compute_similarity(config.store.url, executor="local", metric="cosine")
    rows = api.numpy().astype(np.float64)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    # float32 dot products of unit rows of 48 columns: 1e-5 absolute.
    np.testing.assert_allclose(open_store(config.store.url).similarity(), rows @ rows.T, rtol=0, atol=1e-5)


def test_low_rank_layers_join_the_dense_rest_and_workers_reuse_the_split(tmp_path):
    proj = {"structure": "kronecker", "dim": 40, "dense_layers": ["2"], "rest": "dense"}
    config = mlp_job(tmp_path, projection=proj)
    store = run_without_ray(config)
    info = store.attrs["projection"]
    # Layer 2 by pattern; 0 and 4 see one token per sample (the MLP's inputs are vectors).
    assert info["units"] == [] and sorted(info["dense_layers"]) == ["0", "2", "4"]
    assert info["rest_width"] == 40
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    full = per_class_gradients(model, probe, num_classes=JOB_C)
    want = Projector(full.shape[1], 40, seed=0).project(full)
    # All rest: one dense projection of the whole row; float32 order of the sums differs.
    np.testing.assert_allclose(store.rows(np.arange(JOB_C)), want.numpy(), rtol=1e-5, atol=1e-6)


def test_a_store_made_when_the_rest_was_dense_by_default_is_refused_naming_the_key(tmp_path, monkeypatch):
    """``rest``'s default moved from dense to sketch without a new fingerprint version: such a
    store has the fingerprint of a config that leaves rest out, and is refused (not resumed with
    rows projected another way) by its recorded projection, with the setting that resumes it."""
    from classgrad.errors import StoreMismatchError
    from classgrad.workers.projection.kronecker.kronecker_structure import KroneckerOptions

    field = KroneckerOptions.model_fields["rest"]
    proj = {"structure": "kronecker", "dim": 40}
    with monkeypatch.context() as m:
        m.setattr(field, "default", "dense")  # as before: the key is then not hashed
        old = mlp_job(tmp_path, projection={**proj, "rest": "dense"})
        made = old.fingerprint()
        run_without_ray(old)
    new = mlp_job(tmp_path, projection=proj)
    assert new.projection.rest == "sketch" and new.fingerprint() == made
    with pytest.raises(StoreMismatchError, match="rest: store 'dense', this config 'sketch'"):
        run_without_ray(new)
    resumed = run_without_ray(mlp_job(tmp_path, projection={**proj, "rest": "dense"}))
    assert resumed.attrs["projection"]["rest"] == "dense"


def test_refusals_name_the_dense_structure(tmp_path):
    with pytest.raises(ValueError, match="projection.structure 'dense'"):
        mlp_job(tmp_path, projection={"structure": "kronecker", "dim": 8}, loss={"kind": "logit"})
    with pytest.raises(ValueError, match="of structure kronecker"):
        JobConfig.model_validate(
            {
                **mlp_job(tmp_path).model_dump(mode="json"),
                "projection": {"dim": 8, "structure": "kronecker", "per_param": True},
            }
        )
    x, y = data((12,))
    with pytest.raises(ConfigError, match="use projection.structure=dense"):
        per_class_gradients(Seq(), (x, y), num_classes=C, loss="logit", projection={"structure": "kronecker", "dim": 8})
    # BatchNorm in train mode couples samples: the dense engine, which has no hook path.
    ln = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Linear(8, C))
    with pytest.raises(ConfigError, match="use projection.structure=dense"):
        per_class_gradients(ln, (x, y), num_classes=C, mode="train", projection={"structure": "kronecker", "dim": 8})
    # The dense structure goes on working for such a model, through the API too.
    proj = {"dim": 8, "seed": 1, "structure": "dense"}
    rows = per_class_gradients(ln, (x, y), num_classes=C, mode="train", projection=proj)
    full = per_class_gradients(ln, (x, y), num_classes=C, mode="train")
    torch.testing.assert_close(rows, Projector(full.shape[1], 8, seed=1).project(full), rtol=1e-5, atol=1e-6)
