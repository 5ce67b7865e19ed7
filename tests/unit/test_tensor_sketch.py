"""The default projection, ``structure: tensorsketch``: one CountSketch of the row, in the backward.

Rows from the hook path, on every route of the sketched sums (fft, form, and the embeddings'
direct scatter; unpadded tokens and the padded grid), against the same map applied to the float64
reference engine's full rows, per layer type (Linear on tokens and as a head, Conv1d/2d, Embedding
with a padding row and called twice, EmbeddingBag mean/max, transformers' Conv1D, LSTM/GRU/RNN
and attention weight matrices, norms in the rest), with empty and one-sample classes, frozen and tied
parameters; the map itself (a sparse JL map: unbiased, the structured hash equal to the circular
convolution); a job's store against ``per_class_gradients``; that no per-class head matrix is
formed; the default's fallback; and old stores (dense by the old default, kronecker, sketch, and
tensorsketch from before its units shared one sketch in the work row or before recurrent layers
had units) resuming with the map they record.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from classgrad.config import load_config
from classgrad.errors import ConfigError
from classgrad.service.analysis.inspect import format_report, inspect_store
from classgrad.service.analysis.verify import verify_store
from classgrad.store import open_store
from classgrad.store.core.params import ParamSlot
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.engines.partitioned import projected_engine
from classgrad.workers.gradients import build_engine, per_class_gradients, projection_options
from classgrad.workers.projection import Projector, SketchUnit
from classgrad.workers.projection.kronecker.kronecker_map import KroneckerMap
from classgrad.workers.projection.sketch.row_sketch import RowSketch
from classgrad.workers.projection.tensorsketch import chunked_sketch
from classgrad.workers.projection.tensorsketch import tensorsketch_sums as sketch_sums
from classgrad.workers.projection.tensorsketch.tensorsketch_map import TensorSketchMap
from tests.support.engine_cases import fell_back, max_relative_error
from tests.support.hf_models import hf_probe, tiny_gpt2
from tests.support.jobs import mlp_job, run_without_ray

C = 6
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"

# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


class Mixed(nn.Module):
    """Every layer type with a sketch unit, and a LayerNorm and a raw parameter in the rest."""

    def __init__(self, vocab: int = 13, width: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, width, padding_idx=0)
        self.bag = nn.EmbeddingBag(vocab, 4, mode="mean", padding_idx=0)
        self.bag_max = nn.EmbeddingBag(vocab, 3, mode="max")
        self.mix = nn.Linear(width, 5)  # on 4 tokens per sample
        self.conv = nn.Conv1d(width, 4, 3, padding=1)
        self.img = nn.Conv2d(1, 2, 3, padding=1, stride=2)
        self.norm = nn.LayerNorm(5)
        self.scale = nn.Parameter(torch.ones(5))
        self.head = nn.Linear(5 + 4 + 4 + 3 + 8, C)

    def forward(self, ids):
        e = self.tok(ids) + 0.5 * self.tok(ids.roll(1, dims=1))  # called twice
        h = (self.norm(torch.tanh(self.mix(e))) * self.scale).mean(1)
        c = torch.tanh(self.conv(e.transpose(1, 2))).mean(2)
        img = torch.tanh(self.img(e.reshape(-1, 1, 4, 6))).flatten(1)[:, :8]
        feats = [h, c, self.bag(ids), self.bag_max(ids % 7), img]
        return self.head(torch.cat(feats, dim=1))


def mixed_case():
    torch.manual_seed(6)
    model = Mixed().eval()
    g = torch.Generator().manual_seed(7)
    y = torch.randint(0, C - 1, (23,), generator=g)  # class C - 1 has no samples: a zero row
    y[:9] = 0
    y[9] = 1  # class 1: one sample
    y[10:12] = 2
    ids = torch.randint(0, 13, (23, 4), generator=g)
    ids[:, 0] = 0  # padding_idx in every sample
    return model, (ids, y)


def gpt2_case():
    model = tiny_gpt2(C, seed=2)
    x, y = hf_probe("gpt2", C, per_class=3, seed=3)
    keep = torch.cat([torch.nonzero(y != 1).flatten(), torch.nonzero(y == 1).flatten()[:1]])
    return model, ({k: v[keep] for k, v in x.items()}, y[keep])


def head_case():
    """A wide head on one token per sample (the fft route's case), 1 to 3 samples per class."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, C)).eval()
    y = torch.tensor([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 5])
    return model, (torch.randn(len(y), 7, generator=torch.Generator().manual_seed(2)), y)


class Recurrent(nn.Module):
    """Every recurrent layer type as units: two bidirectional LSTM layers, a GRU, an RNN without
    biases and an LSTM with ``proj_size`` (its ``weight_hr``), on fixed-length token sequences."""

    def __init__(self, vocab: int = 13):
        super().__init__()
        self.tok = nn.Embedding(vocab, 4)
        self.lstm = nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(6, 3, batch_first=True)
        self.rnn = nn.RNN(3, 3, bias=False, batch_first=True)
        self.proj = nn.LSTM(3, 4, proj_size=2, batch_first=True)
        self.head = nn.Linear(2, C)

    def forward(self, ids):
        h, _ = self.lstm(self.tok(ids))
        h, _ = self.rnn(self.gru(h)[0])
        return self.head(self.proj(h)[0][:, -1])


def recurrent_case():
    torch.manual_seed(4)
    model = Recurrent().eval()
    g = torch.Generator().manual_seed(8)
    y = torch.tensor([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4])  # class 5: no samples
    return model, (torch.randint(0, 13, (len(y), 5), generator=g), y)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` as units: a ``TransformerEncoderLayer``'s (one ``in_proj_weight``)
    and one with separate q/k/v weights (``kdim``, ``vdim``; its ``in_proj_bias`` in the rest)."""

    def __init__(self, vocab: int = 13):
        super().__init__()
        self.tok = nn.Embedding(vocab, 4)
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.cross = nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True)
        self.key, self.value = nn.Linear(4, 3), nn.Linear(4, 5)
        self.head = nn.Linear(4, C)

    def forward(self, ids):
        h = self.layer(self.tok(ids))
        return self.head(self.cross(h, self.key(h), self.value(h))[0].mean(1))


def attention_case():
    torch.manual_seed(5)
    model = Attention().eval()
    y = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4])  # class 5: no samples
    return model, (torch.randint(0, 13, (len(y), 6), generator=torch.Generator().manual_seed(9)), y)


CASES = {
    "mixed": mixed_case, "gpt2": gpt2_case, "head": head_case, "recurrent": recurrent_case,
    "attention": attention_case,
}  # fmt: skip
RECURRENT_WEIGHTS = {
    *(f"lstm.weight_{w}_l{n}{d}" for w in ("ih", "hh") for n in (0, 1) for d in ("", "_reverse")),
    "gru.weight_ih_l0", "gru.weight_hh_l0", "rnn.weight_ih_l0", "rnn.weight_hh_l0",
    "proj.weight_ih_l0", "proj.weight_hh_l0", "proj.weight_hr_l0",
}  # fmt: skip


def sketched(case: str, monkeypatch, route: str | None = None, grid: bool = False, **options):
    monkeypatch.setattr(sketch_sums, "FORCED_ROUTE", route)
    if grid:
        monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    model, data = CASES[case]()
    proj = {"dim": 64, "seed": 5} | options
    eng = build_engine(model, data, num_classes=C, batch_size=12, projection=projection_options(proj))
    got = eng.compute(range(C)).rows
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference")
    return eng, got, eng.kmap.project_full(ref.compute(range(C)).rows)


# dim 64: most layers one chunk pair; dim 8: every layer's rows and columns in several chunks
# (the head's 6 rows in one, its 25 columns in four), so every route filters and combines them.
@pytest.mark.parametrize("dim", [64, 8])
@pytest.mark.parametrize("grid", [False, True])
@pytest.mark.parametrize("route", ["fft", "form", None])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_equal_the_map_applied_to_the_float64_reference(case, route, grid, dim, monkeypatch):
    if case == "gpt2" and grid:
        pytest.skip("the padded grid's sums are those of the mixed case's layers; GPT-2 is slow here")
    eng, got, want = sketched(case, monkeypatch, route, grid, dim=dim)
    assert not fell_back(eng) and type(eng.kmap) is TensorSketchMap
    assert eng.stored_dim == got.shape[1] == dim
    if dim == 8:
        assert max(u.chunk_pairs for u in eng.kmap.units) > 1
    # float32 products, FFTs and sums against float64: 1e-5 of the rows' scale.
    assert max_relative_error(got, want) < 1e-5
    if case == "mixed":
        assert got[C - 1].abs().max() == 0  # no samples: a zero row
        units = {u["param"] for u in eng.describe()["units"]}
        assert {"tok.weight", "bag.weight", "bag_max.weight", "mix.weight", "conv.weight", "img.weight"} <= units
        assert {"norm.weight", "norm.bias", "scale"} <= set(eng.describe()["rest_params"])
    if case == "recurrent":  # every weight matrix a unit, with its bias: nothing left in the rest
        units = {u["param"]: u["bias"] for u in eng.describe()["units"]}
        assert RECURRENT_WEIGHTS <= set(units) and eng.describe()["rest_params"] == []
        assert units["lstm.weight_hh_l1_reverse"] == "lstm.bias_hh_l1_reverse" and units["rnn.weight_ih_l0"] is None
    if case == "attention":
        units = {u["param"]: u["bias"] for u in eng.describe()["units"]}
        attn = "layer.self_attn."
        assert units[attn + "in_proj_weight"] == attn + "in_proj_bias"
        assert units[attn + "out_proj.weight"] == attn + "out_proj.bias"
        assert all(units[f"cross.{p}_proj_weight"] is None for p in "qkv")
        assert "cross.in_proj_bias" in eng.describe()["rest_params"]


@pytest.mark.parametrize("route", ["fft", "form"])
def test_one_token_a_sample_is_sketched_unpadded_on_the_fft_route(route, monkeypatch):
    """Classes of 1 to 3 samples: the head's FFT route takes the unpadded tokens (each token's
    class as an owner), the form route one product over the padded grid."""
    owners = []
    real = sketch_sums._fft_sketch
    monkeypatch.setattr(
        sketch_sums,
        "_fft_sketch",
        lambda first, second, owner, *a: owners.append(owner) or real(first, second, owner, *a),
    )
    eng, got, want = sketched("head", monkeypatch, route)
    assert max_relative_error(got, want) < 1e-5  # as in test_rows_equal_the_map_applied_to_the_float64_reference
    if route == "fft":
        _, y = head_case()[1]
        # The run takes its classes by size (``hook_path.size_order``): each token's position there.
        counts = torch.bincount(y[y < C]).sort(stable=True).values
        position = torch.repeat_interleave(torch.arange(len(counts)), counts)
        assert owners and all(o is not None and torch.equal(o, position) for o in owners)
    else:
        assert not owners


@pytest.mark.parametrize("table", ["kept", "hashed per call"])
def test_embedding_lookups_with_and_without_the_kept_bucket_table(table, monkeypatch):
    """The direct route of the embeddings takes each entry's bucket from ``SketchUnit.entry_index``
    (tables up to ``ENTRY_TABLE_ENTRIES``) or hashes it per call (larger ones): the same map."""
    if table != "kept":
        monkeypatch.setattr(chunked_sketch, "ENTRY_TABLE_ENTRIES", 0)
    eng, got, want = sketched("mixed", monkeypatch)
    tok = next(u for u in eng.kmap.units if u.weight.name == "tok.weight")
    assert (tok.entry_index("cpu") is not None) == (table == "kept")
    # float32 sums against float64: 1e-5 of the rows' scale.
    assert max_relative_error(got, want) < 1e-5


@pytest.mark.parametrize("structure", ["tensorsketch", "kronecker"])
@pytest.mark.parametrize("case", ["mixed", "head"])  # a rest sketched over gathered blocks; no rest
def test_rows_written_into_out_are_the_blocks_rows(case, structure, monkeypatch):
    """``iter_blocks(out=...)`` (what ``per_class_gradients`` takes): the same rows, each block's a
    view of ``out``, over groups of 2 classes and the rest gathered 3 rows at a time."""
    monkeypatch.setattr(projected_engine, "REST_ROWS", 3)
    model, data = CASES[case]()
    proj = projection_options({"dim": 64, "seed": 5, "structure": structure})
    eng = build_engine(model, data, num_classes=C, batch_size=12, group_rows=2, projection=proj)
    want = eng.compute(range(C)).rows
    out = torch.full((C, 64), float("nan"))
    blocks = list(eng.iter_blocks(range(C), out=out))
    assert len(blocks) > 1 and sum(len(b) for b in blocks) == C
    done = 0
    for b in blocks:
        assert b.rows.data_ptr() == out[done].data_ptr()  # a view of out, in order
        done += len(b)
    # The same runs and sums in the same order, in one process: the same bits.
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="out must be"):
        next(eng.iter_blocks(range(C), out=torch.empty(C, 63)))


def test_frozen_and_tied_parameters(monkeypatch):
    model, data = mixed_case()
    model.mix.weight.requires_grad_(False)  # frozen: not in the row
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    eng = build_engine(model, data, num_classes=C, projection=projection_options({"dim": 32}))
    assert "mix.weight" not in {s.name for s in eng.full_layout.slots}
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference")
    # As above: float32 against float64.
    assert max_relative_error(eng.compute(range(C)).rows, eng.kmap.project_full(ref.compute(range(C)).rows)) < 1e-5

    class Tied(nn.Module):  # one table read at the input and as the output layer
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(C, 4)

        def forward(self, ids):
            return torch.tanh(self.emb(ids)).mean(1) @ self.emb.weight.t()

    torch.manual_seed(0)
    ids, y = torch.randint(0, C, (14, 3)), torch.randint(0, C, (14,))
    tied = Tied().eval()
    eng = build_engine(tied, (ids, y), num_classes=C, projection=projection_options({"dim": 16}))
    rows = eng.compute(range(C)).rows
    full = per_class_gradients(tied, (ids, y), num_classes=C)
    # The shared table's whole gradient (a module VJP of the model) goes through the same map;
    # float32 sums in another order.
    torch.testing.assert_close(rows, eng.kmap.project_full(full), rtol=1e-5, atol=1e-6)


def test_the_structured_hash_is_the_circular_convolution_of_the_factor_sketches():
    slot = ParamSlot("w", (5, 7), 0, 35)
    unit = SketchUnit(0, slot, None, 5, 7, False, dim=16, nonzeros=1, seed=3)
    g, x = torch.randn(5, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    direct = unit.sketch(torch.outer(g, x).unsqueeze(0))[0]
    sk1, sk2 = unit.factor_sketches()
    a, b = sk1.project(g.unsqueeze(0))[0], sk2.project(x.unsqueeze(0))[0]
    conv = torch.fft.irfft(torch.fft.rfft(a) * torch.fft.rfft(b), n=16)
    torch.testing.assert_close(direct, conv, rtol=1e-10, atol=1e-12)  # float64: roundoff only


@pytest.mark.parametrize("nonzeros", [1, 3])
def test_buckets_of_whole_rows_equal_those_of_any_range(nonzeros):
    slot = ParamSlot("w", (5, 7), 0, 35)
    unit = SketchUnit(0, slot, None, 5, 7, False, dim=16, nonzeros=nonzeros, seed=3)
    whole = unit._flat_columns(0, 35, torch.device("cpu"))  # whole rows: the broadcast route
    parts = [unit._flat_columns(a, b, torch.device("cpu")) for a, b in ((0, 3), (3, 20), (20, 35))]
    assert torch.equal(whole[0], torch.cat([p[0] for p in parts]))  # integers: exact
    assert torch.equal(whole[1], torch.cat([p[1] for p in parts]))
    assert torch.equal(unit._flat_columns(14, 28, torch.device("cpu"))[0], whole[0][14:28])


def test_units_add_into_one_sketch_of_the_work_row(monkeypatch):
    """Every unit's work slot is the same ``dim`` columns (the first layer to write copies, the
    others add: ``ClassRows`` tracks columns, not names), so a work row is ``dim`` plus the rest,
    whatever the number of layers; the stored rows are still the map of the full rows."""
    eng, got, want = sketched("mixed", monkeypatch)
    kmap = eng.kmap
    assert len(kmap.units) >= 6 and {u.offset for u in kmap.units} == {0}
    assert eng.layout.dim == kmap.work_dim == kmap.dim + kmap.rest_size
    assert max_relative_error(got, want) < 1e-5  # float32 against float64, as above
    assert all("offset" not in u for u in kmap.describe()["units"])  # nothing of the work row recorded


def test_a_record_with_unit_offsets_is_described_as_recorded():
    """Stores made while each unit had its own work columns recorded their offsets, and a
    resumed job's record must equal the store's: a map planned from such a record keeps them."""
    model, data = mixed_case()
    eng = build_engine(model, data, num_classes=C, projection=projection_options({"dim": 64}))
    record = eng.describe()
    old = {**record, "units": [{**u, "offset": i * 64} for i, u in enumerate(record["units"])]}
    again = build_engine(model, data, num_classes=C, projection=projection_options({"dim": 64}, old))
    assert again.describe() == old


def test_inner_products_preserved_in_expectation():
    slots = [ParamSlot("w", (6, 9), 0, 54), ParamSlot("rest", (10,), 54, 10)]
    rows = torch.randn(2, 64, dtype=torch.float64)
    exact = float(rows[0] @ rows[1])
    got = []
    for seed in range(120):
        unit = SketchUnit(0, slots[0], None, 6, 9, False, dim=24, nonzeros=1, seed=seed)
        kmap = TensorSketchMap(slots, [unit], dim=24, seed=seed, nonzeros=4)
        p = kmap.project_full(rows)
        got.append(float(p[0] @ p[1]))
    spread = float(np.std(got)) / np.sqrt(len(got))
    assert abs(np.mean(got) - exact) < 4 * spread  # unbiased: within 4 standard errors


class Recorder(TorchDispatchMode):
    """The largest tensor any op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_sparse and t.layout == torch.strided:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_per_class_matrix_of_the_head_is_formed():
    classes, hidden = 3000, 96
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, classes)).eval()
    y = torch.arange(classes).repeat_interleave(2)
    x = torch.randn(len(y), 8)
    eng = build_engine(model, (x, y), num_classes=classes, projection=projection_options({"dim": 256}))
    eng.compute(range(64))  # the one-off spot check (two full rows by the plain path) is done
    with Recorder() as seen:
        rows = eng.compute(range(64, 192)).rows
    assert rows.shape == (128, 256)
    # A run's full head rows would be 128 x 3000 x 97 entries; one class's full head gradient is
    # 3000 x 97. The largest tensor of the run is the head's output gradient, [256, 3000] (2.6 rows).
    assert seen.largest < 8 * classes * (hidden + 1)  # under 8 classes' worth; the run has 128


def test_job_store_matches_python_api_and_resumes_with_the_recorded_map(tmp_path):
    config = mlp_job(tmp_path, projection={"dim": 48, "seed": 3})
    store = run_without_ray(config)
    info = store.attrs["projection"]
    assert info["structure"] == "tensorsketch" and store.dim == 48
    assert [u["param"] for u in info["units"]] == ["0.weight", "2.weight", "4.weight"]
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    api = per_class_gradients(model, probe, num_classes=store.num_classes, projection={"dim": 48, "seed": 3})
    # Same map; only how classes are grouped into runs differs (shards): float32 summation order.
    np.testing.assert_allclose(store.rows(np.arange(store.num_classes)), api.numpy(), rtol=1e-5, atol=1e-7)
    assert verify_store(config.store.url).code == 0
    report = format_report(inspect_store(store))  # what ``classgrad inspect`` prints
    assert "tensorsketch, chunked placement (a layer's rows and columns placed without collisions" in report
    assert "3 layers sketched in the backward" in report
    assert run_without_ray(config).attrs["projection"] == info


def test_the_default_falls_back_to_a_sketch_of_finished_rows_and_says_so():
    x, y = torch.randn(18, 5), torch.arange(C).repeat(3)
    ln = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, C))  # train mode: the dense engine
    eng = build_engine(ln, (x, y), num_classes=C, projection=projection_options({"dim": 8}))
    assert any("finished rows sketched instead" in n for n in eng.stats.notes)
    rows = per_class_gradients(ln, (x, y), num_classes=C, mode="train", projection={"dim": 8, "seed": 1})
    full = per_class_gradients(ln, (x, y), num_classes=C, mode="train")
    # A sparse sign sketch of float32 rows: float32 roundoff.
    torch.testing.assert_close(
        rows, RowSketch(full.shape[1], 8, nonzeros=4, seed=1).project(full), rtol=1e-5, atol=1e-6
    )


def test_a_dim_wider_than_the_row_is_refused_without_a_fallback_warning(caplog):
    """No structure takes it: before, the default logged that finished rows "would be sketched
    instead", then the sketch refused it (issue 45, item 7)."""
    model, data = head_case()
    with caplog.at_level("WARNING"), pytest.raises(ConfigError, match=r"larger than the row it projects"):
        per_class_gradients(model, data, num_classes=C, projection={"dim": 10**9})
    assert not [r for r in caplog.records if "sketched instead" in r.getMessage()]


@pytest.mark.parametrize(
    "name", ["v3_dense_default", "v3_kronecker", "v3_sketch", "v3_tensorsketch", "v3_tensorsketch_recurrent"]
)
def test_a_store_of_the_previous_version_resumes_with_the_map_it_records(name, tmp_path):
    url = tmp_path / f"{name}.zarr"
    shutil.copytree(FIXTURES / f"{name}.zarr", url)
    before = open_store(str(url))
    record, old_rows = before.attrs["projection"], before.rows(np.arange(before.num_classes))
    shutil.rmtree(url / "grads" / "c" / "0")  # shard 0's rows (2 row chunks) are lost
    config = load_config(FIXTURES / f"{name}.yaml", [f"store.url={url}"])
    store = run_without_ray(config)
    assert store.attrs["projection"] == record and store.is_complete
    # The lost rows are computed again with the recorded map: float32 roundoff of the same sums.
    np.testing.assert_allclose(store.rows(np.arange(store.num_classes)), old_rows, rtol=1e-5, atol=1e-7)
    assert verify_store(str(url)).code == 0
    if name == "v3_dense_default":  # and they are a dense projection of the exact rows
        model = build_model(config.model.factory, config.model.kwargs)
        full = per_class_gradients(model, build_probe(config.data.factory, config.data.kwargs), num_classes=12)
        want = Projector(full.shape[1], 16, seed=5).project(full)
        np.testing.assert_allclose(store.rows(np.arange(12)), want.numpy(), rtol=1e-5, atol=1e-6)
    if name == "v3_tensorsketch_recurrent":  # its LSTM's weights stay in the rest, as recorded
        assert "lstm.weight_ih_l0" in record["rest_params"]
        assert not any(u["param"].startswith("lstm.") for u in record["units"])
    if name == "v3_kronecker":
        assert KroneckerMap  # the record keeps its split: same units, same widths
        assert [u["k_out"] * u["k_in"] for u in record["units"]] == [
            u["k_out"] * u["k_in"] for u in store.attrs["projection"]["units"]
        ]
