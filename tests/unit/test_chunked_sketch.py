"""The default TensorSketch placement, ``chunked``: the map's properties and its tail.

The map itself (every entry's image of norm 1, entries of one row or one column of a chunk pair on
distinct columns, unbiased inner products, the fft route's spectra equal to the map of an outer
product); and, over every pair of 2,000 classes of a model whose head is wider than ``dim``, the
nearest neighbours and the worst cosine error of the default's rows against a CountSketch of the
exact rows (issue 44), where the ``hashed`` placement of older stores fails; what ``inspect``,
``verify``, ``similarity`` and ``score`` say of such a store, and its rebuild. The rows of every
route against the float64 reference, and old stores resuming, are in ``test_tensor_sketch.py``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from classgrad.config import load_config
from classgrad.service.analysis.inspect import format_report, inspect_store
from classgrad.service.analysis.score_driver import check_stores
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.analysis.verify import verify_store
from classgrad.store import open_store
from classgrad.store.core.params import ParamSlot
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.gradients import build_engine, per_class_gradients, projection_options
from classgrad.workers.projection import SketchUnit
from classgrad.workers.projection.sketch.row_sketch import RowSketch
from classgrad.workers.projection.tensorsketch import chunked_sketch
from classgrad.workers.projection.tensorsketch.chunked_sketch import ChunkedSketchUnit
from classgrad.workers.projection.tensorsketch.tensorsketch_map import HASHED, TensorSketchMap
from tests.support.jobs import mlp_job, run_without_ray


def unit(rows: int = 11, cols: int = 6, dim: int = 4, seed: int = 3) -> ChunkedSketchUnit:
    return ChunkedSketchUnit(0, ParamSlot("w", (rows, cols), 0, rows * cols), None, rows, cols, False, dim, seed)


def images(u: ChunkedSketchUnit) -> torch.Tensor:
    """``[rows * cols_in, dim]``: the image of every entry (float64)."""
    basis = torch.eye(u.full, dtype=torch.float64).view(u.full, u.rows, u.cols_in)
    return u.sketch(basis)


def test_every_entry_has_norm_one_and_a_row_or_column_of_a_chunk_pair_never_shares_a_column():
    u = unit()
    assert (u.row_chunks, u.col_chunks) == (3, 2)
    img = images(u)
    # An all-pass filter of a signed unit vector: norm 1 up to float64 FFT roundoff.
    torch.testing.assert_close(img.norm(dim=1), torch.ones(u.full, dtype=torch.float64), rtol=0, atol=1e-12)
    gram = img @ img.t()
    i, j = torch.arange(u.rows).repeat_interleave(u.cols_in), torch.arange(u.cols_in).repeat(u.rows)
    pair = (i // u.dim) * u.col_chunks + j // u.dim
    same_pair = (pair[:, None] == pair[None]) & ~torch.eye(u.full, dtype=torch.bool)
    line = same_pair & ((i[:, None] == i[None]) | (j[:, None] == j[None]))
    # Distinct places of one chunk pair: orthogonal (exactly, up to FFT roundoff).
    assert line.any() and gram[line].abs().max() < 1e-12


def test_rows_of_a_wide_head_never_share_their_image():
    """A head of 600 rows into 256 columns (3 row chunks, one input feature): each row's image is
    one unit vector. A hashed placement sends some rows to the same column (overlap 1: the false
    neighbours of issue 44); chunked ones are orthogonal within a chunk and meet across chunks only
    through random all-pass filters, at overlaps of order 1/sqrt(256)."""
    u = unit(rows=600, cols=1, dim=256)
    img = images(u)
    overlap = (img @ img.t()).fill_diagonal_(0).abs()
    assert overlap.max() < 0.35  # measured 0.23: under 4 standard deviations of 1/sqrt(256)
    hashed = SketchUnit(0, u.weight, None, 600, 1, False, dim=256, nonzeros=1, seed=3)
    himg = hashed.sketch(torch.eye(600, dtype=torch.float64).view(600, 600, 1))
    assert (himg @ himg.t()).fill_diagonal_(0).abs().max() == 1


# The CPU's routes (a row chunk at a time), and a GPU's with work-buffer budgets of token_spectra
# (2 tokens x 8 bytes x (2 x dim 4 + 3 x 16 columns placed + 13) = 1,104 bytes a row chunk): every
# row chunk at once, one at a time, two and two, three and the last alone.
@pytest.mark.parametrize("budget", ["cpu", None, 1, 2208, 3312])
def test_the_fft_route_is_the_map_of_an_outer_product(budget, monkeypatch):
    if budget not in ("cpu", None):
        monkeypatch.setattr(chunked_sketch, "SPECTRA_BYTES", budget)
    u = unit(rows=13, cols=13, dim=4)  # 4 row chunks (the last of one row), 4 column chunks
    g, x = torch.randn(2, 13, dtype=torch.float64), torch.randn(2, 13, dtype=torch.float64)
    direct = u.sketch(torch.einsum("ti,tj->tij", g, x))
    with contextlib.nullcontext() if budget == "cpu" else rule_io.routes_as("cuda"):
        spectra = u.from_spectra(u.token_spectra(g, x))
    torch.testing.assert_close(spectra, direct, rtol=1e-10, atol=1e-12)  # float64: roundoff only


@pytest.mark.parametrize("channels", [None, 3])
def test_flat_columns_of_any_range_are_each_entrys_own_column_and_sign(channels):
    # ``_flat_columns`` builds the table a row chunk at a time; ``entry_columns`` is the map's
    # definition entry by entry. Ranges start and stop inside rows and cross row chunks.
    u = ChunkedSketchUnit(0, ParamSlot("w", (11, 9), 0, 99), ParamSlot("b", (11,), 99, 11), 11, 9, False, 4, 5)
    order = torch.arange(u.cols_in) if channels is None else u.column_order(channels)
    for start, stop in [(0, u.full), (3, 4), (5, 47), (u.cols_in * 4 - 1, u.full - 2)]:
        flat = torch.arange(start, stop)
        want_col, want_neg = u.entry_columns(flat // u.cols_in, order[flat % u.cols_in], "cpu")
        col, neg = u._flat_columns(start, stop, torch.device("cpu"), channels)
        assert col.shape == neg.shape == (stop - start, 1)
        assert torch.equal(col[:, 0], want_col) and torch.equal(neg[:, 0], want_neg)


def test_inner_products_preserved_in_expectation():
    rows = torch.randn(2, 11 * 6, dtype=torch.float64)
    exact = float(rows[0] @ rows[1])
    got = []
    for seed in range(150):
        u = unit(seed=seed)
        p = u.sketch(rows.view(2, 11, 6))
        got.append(float(p[0] @ p[1]))
    spread = float(np.std(got)) / np.sqrt(len(got))
    assert abs(np.mean(got) - exact) < 4 * spread  # unbiased: within 4 standard errors


def neighbour_quality(rows: torch.Tensor, exact_cos: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement, recall@10 and the worst cosine error over every pair of classes."""
    r = rows.double()
    r = r / r.norm(dim=1, keepdim=True)
    cos = r @ r.t()
    worst = float((cos - exact_cos).abs().fill_diagonal_(0).max())
    mine, theirs = cos.fill_diagonal_(-9), exact_cos.clone().fill_diagonal_(-9)
    top1 = float((mine.argmax(1) == theirs.argmax(1)).double().mean())
    found, want = mine.topk(10, dim=1).indices, theirs.topk(10, dim=1).indices
    recall = float((found.unsqueeze(2) == want.unsqueeze(1)).any(2).double().mean())
    return {"top1": top1, "recall10": recall, "worst": worst}


@pytest.fixture(scope="module")
def wide_head():
    """2,000 classes of 2 samples, a 16-wide hidden layer and a 2,000-wide head, k = 256: a class
    has about C / k = 8 partners whose head row a hashed placement sends to its own columns."""
    classes, k = 2000, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, classes)).eval()
    y = torch.arange(classes).repeat_interleave(2)
    x = torch.randn(len(y), 16) + 1.0  # positive-mean inputs: correlated features, as a network's
    full = per_class_gradients(model, (x, y), num_classes=classes)
    eng = build_engine(model, (x, y), num_classes=classes, projection=projection_options({"dim": k}))
    exact = full.double() / full.double().norm(dim=1, keepdim=True)
    return eng, full, exact @ exact.t()


def test_nearest_neighbours_over_all_classes_are_a_countsketchs(wide_head):
    eng, full, exact_cos = wide_head
    k = eng.kmap.dim
    default = neighbour_quality(eng.compute(range(full.shape[0])).rows, exact_cos)
    countsketch = neighbour_quality(RowSketch(full.shape[1], k, nonzeros=1, seed=9).project(full), exact_cos)
    # Issue 44's targets, over all C x C pairs. Measured here: default top-1 0.21, recall@10 0.36,
    # worst 0.40; the CountSketch 0.13, 0.32, 0.61 (both maps seeded: the margins are the maps',
    # not luck's; float32 rows, so another BLAS moves these by far less than the margins).
    assert default["top1"] >= countsketch["top1"] - 0.05
    assert default["recall10"] >= countsketch["recall10"] - 0.05
    assert default["worst"] <= 1.5 * countsketch["worst"]
    # The same check catches the hashed placement (stores made before): top-1 0.01, every class
    # with a pair off by more than 0.3.
    kmap = eng.kmap
    hashed_units = [SketchUnit(u.index, u.weight, u.bias, u.a, u.b, u.input_first, k, 1, u.seed) for u in kmap.units]
    hashed = TensorSketchMap(kmap.slots, hashed_units, dim=k, seed=kmap.seed, nonzeros=kmap.nonzeros, placement=HASHED)
    assert neighbour_quality(hashed.project_full(full), exact_cos)["top1"] < countsketch["top1"] - 0.05


# --- stores made with the hashed placement -------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"


@pytest.fixture
def hashed_store(tmp_path):
    """A copy of a store made before the chunked placement (its record has no ``placement``)."""
    url = tmp_path / "v3_tensorsketch.zarr"
    shutil.copytree(FIXTURES / "v3_tensorsketch.zarr", url)
    return str(url)


def test_inspect_and_verify_name_the_placement_and_warn_of_collisions(hashed_store, tmp_path):
    old = format_report(inspect_store(open_store(hashed_store)))
    assert "projection  tensorsketch, hashed placement (one hashed CountSketch" in old
    assert old.count("may hold hash collisions") == 1 and "--set store.overwrite=true" in old
    report = verify_store(hashed_store)
    assert report.code == 0 and report.rows == "tensorsketch, hashed placement"
    assert [n for n in report.notes if "hash collisions" in n] and "rows        tensorsketch" in report.format()
    new = run_without_ray(mlp_job(tmp_path, projection={"dim": 48}))
    text = format_report(inspect_store(new))
    assert "projection  tensorsketch, chunked placement (a layer's rows and columns placed" in text
    assert "hash collisions" not in text and verify_store(new.url).notes == []


def test_similarity_and_score_warn_once_on_a_hashed_store(hashed_store, caplog):
    with caplog.at_level(logging.WARNING, logger="classgrad"):
        compute_similarity(hashed_store, executor="local", top_k=3)
        check_stores([open_store(hashed_store)])  # what every scoring path checks first
    warned = [r for r in caplog.records if "may hold hash collisions" in r.getMessage()]
    assert [r.name for r in warned] == [
        "classgrad.service.analysis.similarity",
        "classgrad.service.analysis.score_driver",
    ]


def test_rerun_with_overwrite_rebuilds_a_hashed_store_with_the_chunked_placement(hashed_store):
    config = load_config(FIXTURES / "v3_tensorsketch.yaml", [f"store.url={hashed_store}", "store.overwrite=true"])
    store = run_without_ray(config)
    record = store.attrs["projection"]
    assert record["placement"] == "chunked" and store.is_complete and verify_store(hashed_store).notes == []
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    api = per_class_gradients(model, probe, num_classes=12, projection={"dim": 16, "seed": 5})
    # The same map as the Python API's default; shards group classes differently: float32 sums.
    np.testing.assert_allclose(store.rows(np.arange(12)), api.numpy(), rtol=1e-5, atol=1e-7)
