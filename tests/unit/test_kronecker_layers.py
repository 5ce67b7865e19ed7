"""Kronecker units of Hugging Face's ``Conv1D`` (GPT-2) and ``nn.Embedding``.

Rows from the hook path, on both routes of the projected sums (unpadded tokens, the CPU's; the
padded grid, a GPU's, forced here on the CPU), against the same factors applied to the float64
reference engine's full rows; what ``describe`` records for these units; and that the layers
read at one token per sample still join the rest (``low_rank: dense``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.gradients import build_engine, projection_options
from tests.support.engine_cases import fell_back, max_relative_error
from tests.support.hf_models import hf_probe, tiny_gpt2

C = 5

# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


class Embedded(nn.Module):
    """Token ids through two tables (one with a padding row, called twice), a Linear per token, a head."""

    def __init__(self, vocab: int = 11, width: int = 6, length: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width, padding_idx=0)
        self.pos = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, 5)
        self.head = nn.Linear(5 * length, C)

    def forward(self, ids):
        h = torch.tanh(self.tok(ids) + 0.5 * self.pos(ids.flip(1)) + 0.25 * self.tok(ids.roll(1, dims=1)))
        return self.head(torch.tanh(self.mix(h)).flatten(1))


def gpt2_case():
    model = tiny_gpt2(C, seed=2)
    x, y = hf_probe("gpt2", C, per_class=4, seed=3)
    keep = torch.cat([torch.nonzero(y != 1).flatten(), torch.nonzero(y == 1).flatten()[:1]])  # unequal classes
    keep = keep[(y[keep] != C - 1)]  # class C - 1 has no samples: a zero row
    return model, ({k: v[keep] for k, v in x.items()}, y[keep])


def embedding_case():
    torch.manual_seed(6)
    model = Embedded().eval()
    g = torch.Generator().manual_seed(7)
    y = torch.randint(0, C - 1, (23,), generator=g)
    y[:7] = 0
    ids = torch.randint(0, 11, (23, 4), generator=g)
    ids[:, 0] = 0  # padding_idx in every sample
    return model, (ids, y)


CASES = {"gpt2": gpt2_case, "embedding": embedding_case}


def projected(case: str, route: str, monkeypatch, **options):
    if route == "grid":
        monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    model, data = CASES[case]()
    proj = {"structure": "kronecker", "dim": 60, "seed": 5} | options
    eng = build_engine(model, data, num_classes=C, batch_size=12, projection=projection_options(proj))
    got = eng.compute(range(C)).rows
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference")
    return eng, got, eng.kmap.project_full(ref.compute(range(C)).rows)


@pytest.mark.parametrize("route", ["ragged", "grid"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rest", ["dense", "keep"])
def test_rows_equal_factors_applied_to_the_float64_reference(case, route, rest, monkeypatch):
    options = {"rest": rest, "dim": 3000 if rest == "keep" and case == "gpt2" else 200 if rest == "keep" else 60}
    eng, got, want = projected(case, route, monkeypatch, **options)
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert want.dtype == torch.float64 and got.shape == want.shape == (C, options["dim"])
    # fp32 sums of products in another order than the float64 reference: 1e-5 relative.
    assert max_relative_error(got, want) <= 1e-5
    assert bool((got[C - 1] == 0).all())  # the empty class
    units = {u["param"]: u for u in eng.describe()["units"]}
    if case == "gpt2":
        assert {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"} <= set(units)
        assert all(u.get("input_first") for name, u in units.items())  # Conv1D [in, out] and tables
    else:
        assert set(units) == {"tok.weight", "pos.weight", "mix.weight"}


def test_described_units_of_gpt2_and_the_one_token_layers_in_the_rest(monkeypatch):
    eng, _, _ = projected("gpt2", "ragged", monkeypatch)
    described = eng.describe()
    units = {u["param"]: u for u in described["units"]}
    c_attn = units["transformer.h.0.attn.c_attn.weight"]
    # Stored [in, out] = [16, 48]: the bias is a row of [W; b^T], so F_a has in + 1 rows.
    assert c_attn["bias"] == "transformer.h.0.attn.c_attn.bias" and c_attn["shape"] == [16, 48]
    assert c_attn["input_first"] and c_attn["factor_shapes"] == [[c_attn["k_out"], 17], [c_attn["k_in"], 48]]
    wte = units["transformer.wte.weight"]
    assert wte["bias"] is None and wte["factor_shapes"][0][1] == 48 and wte["input_first"]
    # The classifier reads the last token: the last block's MLP and attention output see one
    # token per sample and join the rest, with the score head (low_rank: dense); the last
    # block's c_attn (keys and values of every token) stays a unit.
    assert described["dense_layers"] == [
        "transformer.h.1.attn.c_proj",
        "transformer.h.1.mlp.c_fc",
        "transformer.h.1.mlp.c_proj",
        "score",
    ]
    assert "transformer.h.1.attn.c_attn.weight" in units
    assert "transformer.h.1.mlp.c_fc.bias" in described["rest_params"]
    assert all(u["tokens_per_sample"] > 1 for u in units.values())
    # Linear units keep the record they had (no input_first key).
    linear = projected("embedding", "ragged", monkeypatch)[0].describe()["units"]
    assert [u["param"] for u in linear if "input_first" not in u] == ["mix.weight"]


@pytest.mark.parametrize("route", ["ragged", "grid"])
def test_a_table_read_at_one_token_per_sample_joins_the_rest_unless_low_rank_is_kronecker(route, monkeypatch):
    """1-D ids: one token per sample, a per-class gradient of rank at most the class's samples."""
    if route == "grid":
        monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    torch.manual_seed(8)
    model = nn.Sequential(nn.Embedding(13, 7), nn.Tanh(), nn.Linear(7, C)).eval()
    _, (ids, y) = embedding_case()
    ids = ids[:, 1]
    for low_rank, units in (("dense", []), ("kronecker", ["0.weight", "2.weight"])):
        proj = {"structure": "kronecker", "dim": 30, "seed": 1, "low_rank": low_rank}
        eng = build_engine(model, (ids, y), num_classes=C, projection=projection_options(proj))
        got = eng.compute(range(C)).rows
        described = eng.describe()
        assert [u["param"] for u in described["units"]] == units
        assert described["dense_layers"] == (["0", "2"] if low_rank == "dense" else [])
        ref = build_engine(copy.deepcopy(model).double(), (ids, y), num_classes=C, engine="reference")
        # fp32 sums of products in another order than the float64 reference: 1e-5 relative.
        assert max_relative_error(got, eng.kmap.project_full(ref.compute(range(C)).rows)) <= 1e-5


@pytest.mark.parametrize("route", ["ragged", "grid"])
def test_conv1d_units_without_their_bias_selected(route, monkeypatch):
    """Weights only (biases excluded): the units' matrices are ``W`` alone, ``F_a`` of ``in`` rows."""
    if route == "grid":
        monkeypatch.setattr(rule_io, "CPU_ROUTE_DEVICES", ())
    model, data = gpt2_case()
    params = ["*.weight", "transformer.h.0.attn.c_attn.bias"]  # one bias kept: a mixed layout
    proj = {"structure": "kronecker", "dim": 60, "seed": 2}
    eng = build_engine(model, data, num_classes=C, params=params, projection=projection_options(proj))
    got = eng.compute(range(C)).rows
    units = {u["param"]: u for u in eng.describe()["units"]}
    assert units["transformer.h.0.mlp.c_fc.weight"]["bias"] is None
    assert units["transformer.h.0.mlp.c_fc.weight"]["factor_shapes"][0][1] == 16  # in, no bias row
    assert units["transformer.h.0.attn.c_attn.weight"]["factor_shapes"][0][1] == 17
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, params=params, engine="reference")
    # fp32 sums of products in another order than the float64 reference: 1e-5 relative.
    assert max_relative_error(got, eng.kmap.project_full(ref.compute(range(C)).rows)) <= 1e-5
