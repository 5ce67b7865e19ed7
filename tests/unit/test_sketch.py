"""The sparse sign sketch (``projection.rest: sketch`` of a Kronecker projection).

Its buckets and signs against the documented formula recomputed with Python integers, against
an explicit dense matrix, one distinct column per block; the chunked and cached paths; inner
products preserved in expectation; and a job whose rest is sketched: the stored rows against the
same sketch of the exact rows, what the store records, ``inspect`` and ``verify``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classgrad.config import ProjectionConfig
from classgrad.errors import ConfigError
from classgrad.service.analysis.inspect import format_report, inspect_store
from classgrad.service.analysis.verify import verify_store
from classgrad.store.core.params import ParamSlot
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import per_class_gradients
from classgrad.workers.projection import mix32_int, stream_keys
from classgrad.workers.projection.kronecker.kronecker_map import KroneckerMap, KroneckerUnit
from classgrad.workers.projection.sketch import row_sketch as sketch_module
from classgrad.workers.projection.sketch.row_sketch import SKETCH_GROUP, RowSketch, SparseSignSketch, sketch_blocks
from tests.support.devices import needs_cuda
from tests.support.engine_cases import max_relative_error
from tests.support.jobs import MLP_JOB_CLASSES, mlp_job, run_without_ray

pytestmark = pytest.mark.usefixtures("fresh_choices")


def formula_columns(seed: int, group: int, j: int, k: int, s: int) -> list[tuple[int, bool]]:
    """(column, negative) of coordinate ``j``, from the module docstring with Python integers."""
    key_row, key_col = stream_keys(seed, group)
    a = mix32_int(j ^ key_row)
    out = []
    for b, (start, size) in enumerate(sketch_blocks(k, s)):
        w = mix32_int(a ^ mix32_int(mix32_int(b ^ key_col)))
        out.append((start + (((w >> 1) * size) >> 31), bool(w & 1)))
    return out


@pytest.mark.parametrize("k, s", [(12, 1), (12, 3), (13, 4), (1459, 4), (3, 8)])
def test_buckets_and_signs_follow_the_documented_formula(k, s):
    sk = SparseSignSketch(300, k, nonzeros=s, seed=2**40 + 7)
    cols, neg = sk.columns(0, 300)
    for j in (0, 1, 17, 299):
        assert [(int(c), bool(n)) for c, n in zip(cols[j], neg[j])] == formula_columns(
            2**40 + 7, SKETCH_GROUP, j, k, sk.nonzeros
        )
    assert sk.nonzeros == min(s, k)  # more nonzeros than columns: one per column
    # One column in each block, so a coordinate's columns are distinct.
    for b, (start, size) in enumerate(sk.blocks):
        assert bool(((cols[:, b] >= start) & (cols[:, b] < start + size)).all())
    assert all(len(set(row.tolist())) == sk.nonzeros for row in cols)
    # Every column is used and signs are balanced (300 coordinates: loose bounds).
    if k == 12:
        assert set(cols.flatten().tolist()) == set(range(12))
        assert 0.35 < float(neg.double().mean()) < 0.65
    # Regenerated from what a store records (a range of coordinates gives the same bits).
    rec = sk.describe()
    again = SparseSignSketch(300, k, nonzeros=rec["nonzeros"], seed=rec["seed"], group=rec["group"])
    assert torch.equal(again.columns(0, 300)[0], cols) and torch.equal(again.columns(40, 90)[1], neg[40:90])
    assert rec["blocks"] == [list(b) for b in sketch_blocks(k, sk.nonzeros)]


@needs_cuda
def test_buckets_and_signs_same_on_cuda():
    sk = SparseSignSketch(5000, 1459, nonzeros=4, seed=11)
    cols, neg = sk.columns(0, 5000, "cuda")
    assert torch.equal(cols.cpu(), sk.columns(0, 5000)[0]) and torch.equal(neg.cpu(), sk.columns(0, 5000)[1])
    x = torch.randn(9, 5000, generator=torch.Generator().manual_seed(2))
    # float32 sums in another order (CUDA's atomic adds): 1e-5 relative.
    assert max_relative_error(sk.project(x.cuda()).cpu(), sk.project(x)) <= 1e-5


def test_sketch_equals_the_explicit_matrix_of_its_buckets_and_signs():
    D, k, s = 57, 10, 3
    sk = SparseSignSketch(D, k, nonzeros=s, seed=3)
    cols, neg = sk.columns(0, D)
    dense = torch.zeros(D, k, dtype=torch.float64)
    for j in range(D):
        for c, n in zip(cols[j].tolist(), neg[j].tolist()):
            dense[j, c] = (-1.0 if n else 1.0) / np.sqrt(s)
    assert torch.equal(sk.matrix(), dense)
    assert torch.allclose((dense**2).sum(1), torch.ones(D, dtype=torch.float64))  # unit columns of S^T
    x = torch.randn(7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = sk.project(x)
    assert got.dtype == torch.float64 and got.shape == (7, k)
    # float64 sums in another order (positive and negative halves apart): 1e-12 relative.
    assert max_relative_error(got, x @ dense) <= 1e-12
    assert sk.project(x.float()).dtype == torch.float32


@pytest.mark.parametrize("s", [1, 3])
def test_narrow_rows_with_signed_values_equal_the_folded_route_and_the_matrix(s, monkeypatch):
    D, k = 50, 24  # D <= SIGNED_VALUES_WIDTH * k: the signs multiplied into the values
    assert D <= sketch_module.SIGNED_VALUES_WIDTH * k
    x = torch.randn(6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    sk = SparseSignSketch(D, k, nonzeros=s, seed=7)
    rows = torch.full((6, k + 8), float("nan"), dtype=torch.float64)
    signed = sk.signed.apply(x, rows[:, 4 : 4 + k])  # into a strided view, as the engines write
    assert any(key.startswith("signed:") for key in sk.signed._cache)
    assert rows[:, :4].isnan().all() and rows[:, 4 + k :].isnan().all()
    monkeypatch.setattr(sketch_module, "SIGNED_VALUES_WIDTH", 0)  # the folded route, forced
    folded = SparseSignSketch(D, k, nonzeros=s, seed=7).project(x)
    # float64 sums of the same terms, signed in place against halves subtracted: 1e-12 relative.
    assert max_relative_error(signed, folded) <= 1e-12
    assert max_relative_error(signed, x @ sk.matrix()) <= 1e-12


def test_chunked_and_regenerated_indices_give_the_cached_result(monkeypatch):
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1))
    whole = SparseSignSketch(1000, 33, nonzeros=4, seed=9).project(x)
    monkeypatch.setattr(sketch_module, "CHUNK", 64)  # 16 chunks, the last a partial one
    monkeypatch.setattr(sketch_module, "CACHE_ENTRIES", 100)  # nothing cached: generated per chunk
    sk = SparseSignSketch(1000, 33, nonzeros=4, seed=9)
    chunked = sk.project(x)
    assert not sk.signed._cache
    # float32 sums of the same terms grouped by chunks: 1e-5 relative.
    assert max_relative_error(chunked, whole) <= 1e-5


def test_the_sparse_product_route_gives_the_indexed_adds_result(monkeypatch):
    # Devices whose adds are unordered (CUDA) take a CSR product: forced here on the CPU.
    x = torch.randn(6, 700, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    adds = SparseSignSketch(700, 40, nonzeros=3, seed=4).project(x)
    monkeypatch.setattr(sketch_module, "ORDERED_ADD_DEVICES", ())
    sk = SparseSignSketch(700, 40, nonzeros=3, seed=4)
    product = sk.project(x)
    assert any(key.startswith("csr:") for key in sk.signed._cache)
    # float64 sums of the same terms in another order (signed, not halves apart): 1e-12 relative.
    assert max_relative_error(product, adds) <= 1e-12


def test_a_sketch_written_into_a_view_of_wider_rows_equals_the_returned_one():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    sk = SparseSignSketch(300, 24, nonzeros=2, seed=5)
    rows = torch.full((5, 40), float("nan"))
    got = sk.signed.apply(x, rows[:, 8:32])  # a strided view: the rows' columns of one unit
    assert got.data_ptr() == rows[:, 8:32].data_ptr()
    # The same adds in the same order, only the destination differs: exact.
    assert torch.equal(rows[:, 8:32], sk.project(x))
    assert rows[:, :8].isnan().all() and rows[:, 32:].isnan().all()


@pytest.mark.parametrize("s", [1, 4])
def test_inner_products_and_norms_preserved_in_expectation(s):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, dtype=torch.float64, generator=g)
    x[:3] *= 10  # a few heavy coordinates: the case where collisions matter most
    y = 0.5 * x + torch.randn(200, dtype=torch.float64, generator=g)
    rows = torch.stack([x, y])
    ip, sq = [], []
    for seed in range(400):
        px, py = SparseSignSketch(200, 16, nonzeros=s, seed=seed).project(rows)
        ip.append(float(px @ py))
        sq.append(float(px @ px))
    # 400 independent estimates each: the means are within 4 standard errors of the truth (a
    # false failure has probability below 1e-4 for each).
    for est, truth in ((ip, float(x @ y)), (sq, float(x @ x))):
        assert abs(np.mean(est) - truth) < 4 * np.std(est) / np.sqrt(len(est))


def test_sketched_rest_in_the_map_and_its_record():
    slots = [
        ParamSlot("l.weight", (6, 5), 0, 30),
        ParamSlot("l.bias", (6,), 30, 6),
        ParamSlot("n.weight", (20,), 36, 20),
    ]
    unit = KroneckerUnit(0, slots[0], slots[1], 6, 5)
    options = {"dim": 14, "kind": "rademacher", "seed": 4, "allocation": "size"}
    kmap = KroneckerMap(slots, [unit], rest_mode="sketch", sketch_nonzeros=2, **options)
    assert isinstance(kmap.rest_projector, SparseSignSketch) and kmap.rest_projector.nonzeros == 2
    record = kmap.describe()
    assert record["rest"] == "sketch" and record["rest_groups"] is None
    assert record["rest_sketch"]["nonzeros"] == 2 and record["rest_sketch"]["group"] == SKETCH_GROUP
    assert unit.width + record["rest_width"] == 14
    full = torch.randn(3, 56, dtype=torch.float64)
    stored = kmap.project_full(full)
    want = SparseSignSketch(20, record["rest_width"], nonzeros=2, seed=4).project(full[:, 36:])
    assert torch.equal(stored[:, unit.width :], want)
    # A dense or kept rest records what it recorded before (no rest_sketch key): resumes compare equal.
    assert (
        "rest_sketch"
        not in KroneckerMap(
            slots, [KroneckerUnit(0, slots[0], slots[1], 6, 5)], rest_mode="dense", **options
        ).describe()
    )
    # A store whose rest was projected another way is refused.
    with pytest.raises(ConfigError, match="store's rest is 'sketch'"):
        KroneckerMap(slots, [KroneckerUnit(0, slots[0], slots[1], 6, 5)], rest_mode="dense", fixed=record, **options)
    assert ProjectionConfig.model_validate({"dim": 8, "structure": "kronecker", "rest": "sketch"}).sketch_nonzeros == 4


def test_job_with_a_sketched_rest_stores_the_sketch_of_the_exact_rows(tmp_path):
    # The MLP's layers all see one token per sample (low_rank: dense): the whole row is the rest.
    proj = {"structure": "kronecker", "dim": 40, "seed": 6, "rest": "sketch", "sketch_nonzeros": 3}
    config = mlp_job(tmp_path, projection=proj)
    store = run_without_ray(config)
    info = store.attrs["projection"]
    assert info["units"] == [] and info["rest"] == "sketch" and info["rest_width"] == 40
    assert info["rest_sketch"]["nonzeros"] == 3
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    full = per_class_gradients(model, probe, num_classes=MLP_JOB_CLASSES)
    want = SparseSignSketch(full.shape[1], 40, nonzeros=3, seed=6).project(full)
    rows = store.rows(np.arange(MLP_JOB_CLASSES))
    # Same sketch; the full rows' float32 sums are grouped differently (shards of 8): 1e-5 relative.
    assert max_relative_error(torch.from_numpy(rows), want) <= 1e-5
    api = per_class_gradients(model, probe, num_classes=MLP_JOB_CLASSES, projection=proj)
    assert max_relative_error(api, want) <= 1e-5  # the Python API: the same rows
    report = format_report(inspect_store(store))
    assert "rest (sparse sign sketch, 3 nonzeros per parameter): 40 cols at 0" in report
    assert verify_store(config.store.url).code == 0
    assert run_without_ray(config).attrs["projection"] == info  # a resume reuses the record


def test_a_job_sketching_whole_rows_stores_the_sketch_of_the_exact_rows(tmp_path):
    """``structure: sketch``: finished rows of any engine sketched as they come (no matrix to
    generate, nothing gathered); the job, the Python API and a RowSketch of the exact rows agree."""
    proj = {"structure": "sketch", "dim": 40, "seed": 2, "sketch_nonzeros": 3}
    config = mlp_job(tmp_path, projection=proj)
    store = run_without_ray(config)
    info = store.attrs["projection"]
    assert info["structure"] == "sketch" and info["out_dim"] == 40 and info["nonzeros"] == 3
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    full = per_class_gradients(model, probe, num_classes=MLP_JOB_CLASSES)
    want = RowSketch(full.shape[1], 40, nonzeros=3, seed=2).project(full)
    # The same sketch of rows summed in another grouping (shards of 8): 1e-5 relative.
    assert max_relative_error(torch.from_numpy(store.rows(np.arange(MLP_JOB_CLASSES))), want) <= 1e-5
    api = per_class_gradients(model, probe, num_classes=MLP_JOB_CLASSES, projection=proj)
    assert max_relative_error(api, want) <= 1e-5
    assert "projection  sketch (sparse signs, 3 per entry)" in format_report(inspect_store(store))
    assert verify_store(config.store.url).code == 0
    with pytest.raises(ValueError, match="of structure sketch"):
        ProjectionConfig.model_validate({"dim": 8, "structure": "sketch", "per_param": True})
