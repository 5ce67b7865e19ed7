"""Module-local VJP units and mixed hook plans (``layer_rules.module_vjp``, ``partitioned.hook_plan``).

Every model here has parameters no layer rule covers; the partitioned engine must still take the
hook path (rules where they apply, a VJP of the holding module alone elsewhere) and give the
float64 reference engine's rows. Also: the last resort (one forward per pack, a backward per
class) and the engine's one path line.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from classgrad.workers.engines import choices
from classgrad.workers.engines.layer_rules import RULES, register_rule
from classgrad.workers.engines.layer_rules.module_vjp import (
    UNIT_COMPUTERS,
    module_class_grads,
    register_unit_computer,
    unit_computer_for,
)
from classgrad.workers.engines.layer_rules.recurrent import recurrent_unit
from classgrad.workers.engines.partitioned.engine import FALLBACK
from classgrad.workers.gradients import build_engine
from tests.support.engine_cases import TiedMLP, WeightUsedOutside, fell_back, max_relative_error
from tests.support.hf_models import HF_BUILDERS, hf_probe
from tests.support.rule_cases import Scale

C = 6
N = 13  # probe samples: classes of 3, 1, 3, 3, 0 and 3 samples (_probe)
BATCH = 8  # several runs per model, classes of 1 to 3 samples packed together

# fp32 rows against the float64 reference: a few float32 roundoffs over these tiny models (the
# engines' contract, test_engines); 1e-5 leaves room for the longer sums of the transformers.
TOL = 1e-5


# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


def _probe(x, seed: int = 0):
    """Labels for ``x``'s ``N`` samples: 3 of each class but class 1 (one) and class 4 (none), shuffled."""
    assert len(x) == N
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([c for c in range(C) if c != 4 for _ in range(1 if c == 1 else 3)])
    return labels[torch.randperm(len(labels), generator=g)]


def _rows(model: nn.Module, data, **options):
    """(engine, its rows, the float64 reference rows) for all classes."""
    eng = build_engine(model, data, num_classes=C, engine="partitioned", batch_size=BATCH, **options)
    got = eng.compute(range(C)).rows
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference").compute(range(C)).rows
    return eng, got, ref


def _on_hooks(eng) -> None:
    """The hook path did every row: no path given up, no module lifted, the spot check passed."""
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert not eng._hooked.lifts, eng._hooked.lifts


# --- Hugging Face models (tiny configs, as transformers defines them: no wrapper) --------------------------


@pytest.mark.parametrize("name", sorted(HF_BUILDERS))
def test_hf_models_take_the_hook_path_and_match_the_reference(name):
    model = HF_BUILDERS[name](C)
    data = hf_probe(name, C, 3)
    eng, got, ref = _rows(model, data)
    _on_hooks(eng)
    assert max_relative_error(got, ref) <= TOL


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_hf_units_take_one_copy_per_sample_after_the_check(name):
    """LlamaRMSNorm (a gain ``[H]``) and ViTEmbeddings (class token and position embeddings
    ``[1, ...]``): one VJP over the run with per-sample copies, not a VJP per class."""
    model = HF_BUILDERS[name](C)
    eng, got, ref = _rows(model, hf_probe(name, C, 3))
    _on_hooks(eng)
    units = list(eng._hooked.plan.units)
    assert units and all(choices.PER_SAMPLE_LEAVES.get(m) is True for m in units), units
    assert max_relative_error(got, ref) <= TOL


# The engines' low-precision bounds (engine_cases.LOW_PRECISION_TOLERANCE: about 20 unit
# roundoffs); observed here 3e-4 to 1e-3 in fp16 and 3e-3 to 7e-3 in bf16.
HALF_TOL = {"fp16": 1e-2, "bf16": 1e-1}


@pytest.mark.parametrize("name,precision", [("bert", "fp16"), ("llama", "bf16"), ("gpt2", "bf16")])
def test_hf_models_in_half_precision_keep_the_hook_path(name, precision):
    model = HF_BUILDERS[name](C)
    data = hf_probe(name, C, 8)
    eng = build_engine(model, data, num_classes=C, engine="partitioned", batch_size=16, precision=precision)
    got = eng.compute(range(C)).rows
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference").compute(range(C)).rows
    _on_hooks(eng)
    assert max_relative_error(got, ref) <= HALF_TOL[precision]


# --- raw parameters, attention, recurrent layers, control flow ---------------------------------


class Tokens(nn.Module):
    """A ViT-style stem: patches projected, a class token in front, position embeddings added."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.pos_embed = nn.Parameter(torch.randn(1, 6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), h], dim=1) + self.pos_embed


class RawParams(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = Tokens()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(8))
        self.head = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tokens(x)[:, 0] * self.scale))


def test_raw_parameters_are_exact_by_their_modules_vjp():
    """``cls_token.expand`` and ``x + pos_embed`` in a submodule, and a raw parameter of the model
    itself (a unit of the whole model, its Linear layers still by their rule)."""
    model = RawParams().eval()
    x = torch.randn(N, 5, 4)
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    plan = eng._hooked.plan
    assert set(plan.units) == {model.tokens, model} and set(plan.rules) == {model.tokens.proj, model.head}
    assert set(plan.layers[model.tokens]) == {"cls_token", "pos_embed"}
    # Broadcast parameters ([1, ...]) and the model's elementwise gain ([8]) get one copy per
    # sample once the first run's check against the VJP per class has passed.
    assert choices.PER_SAMPLE_LEAVES.get(model.tokens) is True and choices.PER_SAMPLE_LEAVES.get(model) is True
    assert max_relative_error(got, ref) <= TOL


class FirstCopy(nn.Module):
    """A broadcast parameter read as ``offset[0]``: with one copy per sample every sample would
    read sample 0's copy, so the copies' gradients are not the samples' own."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(1, 8))
        self.head = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x + self.offset[0]))


class RawMatrix(nn.Module):
    """A raw weight matrix in a matmul: per-sample copies would work, but their gradients
    (``[samples, 8, 8]``) are bigger than the output's: the VJP per class takes it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.head = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.w))


@pytest.mark.parametrize("make", [FirstCopy, RawMatrix], ids=["misattributed", "too_big"])
def test_per_sample_copies_refused_on_the_first_run_keep_the_rows_exact(make):
    """Copies whose gradients are not the samples' own (caught by the first run's check), or
    bigger than what a sample holds (never tried): the VJP per class from then on."""
    model = make().eval()
    x = torch.randn(N, 8)
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    assert choices.PER_SAMPLE_LEAVES.get(model) is False
    assert max_relative_error(got, ref) <= TOL


class Attention(nn.Module):
    """``nn.MultiheadAttention`` with a key padding mask (it reads ``out_proj.weight`` without
    calling ``out_proj``), batch-first or sequence-first."""

    def __init__(self, batch_first: bool):
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, C)

    def forward(self, batch: dict) -> torch.Tensor:
        h, mask = self.inp(batch["x"]), batch["mask"]
        if not self.batch_first:
            h = h.transpose(0, 1)
        a, _ = self.attn(h, h, h, key_padding_mask=~mask)
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.head((a * mask.unsqueeze(-1)).sum(1))


def _masked(n: int, length: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    return {"x": torch.randn(n, length, 4, generator=g), "mask": torch.arange(length) < lengths.unsqueeze(1)}


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_is_one_exact_unit(batch_first):
    model = Attention(batch_first).eval()
    x = _masked(N)
    eng, got, ref = _rows(model, (x, _probe(x["x"])))
    _on_hooks(eng)
    assert model.attn in eng._hooked.plan.layers  # one module handles all its parameters
    assert "out_proj.weight" in eng._hooked.plan.layers[model.attn]
    assert max_relative_error(got, ref) <= TOL


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase], batch_first: bool):
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.emb = nn.Embedding(12, 6)
        self.rnn = kind(6, 5, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(10, C)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        out = self.rnn(h if self.batch_first else h.transpose(0, 1))[0]
        return self.head(out[:, -1] if self.batch_first else out[-1])


@pytest.mark.parametrize("kind,batch_first", [(nn.LSTM, True), (nn.GRU, False), (nn.RNN, True)])
def test_recurrent_layers_are_exact_units(kind, batch_first):
    model = Recurrent(kind, batch_first).eval()
    ids = torch.randint(0, 12, (N, 4), generator=torch.Generator().manual_seed(0))
    eng, got, ref = _rows(model, (ids, _probe(ids)))
    _on_hooks(eng)
    assert model.rnn in eng._hooked.plan.layers and model.emb in eng._hooked.plan.layers
    assert max_relative_error(got, ref) <= TOL


class MaskBranches(nn.Module):
    """Data-dependent control flow on the mask (vmap of the model cannot run it) and a norm layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, C)

    def forward(self, batch: dict) -> torch.Tensor:
        h, mask = self.norm(self.inp(batch["x"])), batch["mask"]
        if bool((~mask).any()):  # padding present: masked mean, else a plain mean
            return self.head((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))
        return self.head(h.mean(1))


def test_data_dependent_control_flow_keeps_the_hook_path():
    model = MaskBranches().eval()
    x = _masked(N)
    eng, got, ref = _rows(model, (x, _probe(x["x"])))
    _on_hooks(eng)
    assert model.norm in eng._hooked.plan.layers
    assert max_relative_error(got, ref) <= TOL


class GainEncoder(nn.Module):
    """A module with a raw parameter that returns a Hugging Face ``ModelOutput``."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(8))

    def forward(self, h: torch.Tensor, scale: float = 1.0):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=torch.tanh(h * self.gain) * scale, hidden_states=(h,))


class WithModelOutput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.enc = GainEncoder()
        self.head = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x), scale=2.0).last_hidden_state)


def test_a_unit_returning_a_model_output_with_keyword_arguments():
    model = WithModelOutput().eval()
    x = torch.randn(N, 4)
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    assert set(eng._hooked.plan.units) == {model.enc}
    assert max_relative_error(got, ref) <= TOL


# --- tied parameters, lifting ---------------------------------------------------------------


class TiedHead(nn.Module):
    """An embedding whose weight is also the output layer's (a tied language-model head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(C, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, C)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(ids).mean(1))))


@pytest.mark.parametrize("case", ["linear_linear", "embedding_head"])
def test_tied_parameters_add_both_modules_contributions(case):
    if case == "linear_linear":  # one weight in two Linear layers: both by the Linear rule
        model = TiedMLP(C).eval()
        x = torch.randn(N, 8)
    else:  # the embedding by its module's VJP, the head by the Linear rule, same columns
        model = TiedHead().eval()
        x = torch.randint(0, C, (N, 3), generator=torch.Generator().manual_seed(0))
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    holders = [
        m for m, slots in eng._hooked.plan.layers.items() if any(s.name.endswith("weight") for s in slots.values())
    ]
    assert len(holders) >= 3
    assert max_relative_error(got, ref) <= TOL


def test_a_parameter_used_outside_its_module_is_lifted_to_the_parent():
    """``enc.weight`` is also used by the model's own forward: ``enc``'s parameters go to a unit
    of the whole model (exact), the head keeps its rule."""
    model = WeightUsedOutside(C).eval()
    x = torch.randn(N, 8)
    eng, got, ref = _rows(model, (x, _probe(x)))
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert eng._hooked.lifts and set(eng._hooked.plan.units) == {model}
    assert set(eng._hooked.plan.rules) == {model.head}
    assert any("lifted" in note for note in eng.stats.notes), eng.stats.notes
    assert max_relative_error(got, ref) <= TOL


def test_a_module_with_its_own_forward_hook_is_handled_by_its_parent():
    model = RawParams().eval()
    model.tokens.proj.register_forward_hook(lambda m, args, out: out * 2)
    x = torch.randn(N, 5, 4)
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    assert model.tokens.proj not in eng._hooked.plan.layers
    assert {"proj.weight", "proj.bias", "cls_token", "pos_embed"} == set(eng._hooked.plan.layers[model.tokens])
    assert max_relative_error(got, ref) <= TOL


class FrozenScale(nn.Module):
    """A unit whose output is changed in place (``ReLU(inplace=True)``) and one run under no_grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.scale = Scale(8)
        self.fixed = Scale(4)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shift = self.fixed(x).sum(1, keepdim=True)
        return self.head(self.relu(self.scale(self.inp(x))) + shift)


def test_units_changed_in_place_or_run_under_no_grad():
    model = FrozenScale().eval()
    x = torch.randn(N, 4)
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    copies = eng._hooked.copies  # the in-place ReLU on the unit's output was noticed: that unit copies
    assert copies(model.scale) and not copies(model.head) and not copies.every
    assert {model.scale, model.fixed} <= set(eng._hooked.plan.units)
    for name in ("fixed.weight", "fixed.bias"):  # no gradient under no_grad: zero columns
        slot = eng.layout.slot(name)
        assert not got[:, slot.offset : slot.offset + slot.size].any(), name
    assert max_relative_error(got, ref) <= TOL


class Positions(nn.Module):
    """Position embeddings with no sample dimension: ``[1, T, H]`` from ``position_ids [1, T]``."""

    def __init__(self, reshaped: bool):
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Embedding(5, 8)
        self.inp = nn.Linear(4, 8)
        self.head = nn.Linear(8, C)
        self.reshaped = reshaped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(x.shape[1]).unsqueeze(0))
        if self.reshaped:  # only a [1, T, H] tensor can take this view
            p = p.view(x.shape[1], -1)
        return self.head(torch.tanh(self.inp(x) + p).mean(1))


@pytest.mark.parametrize("reshaped", [False, True])
def test_broadcast_outputs_are_split_per_sample_or_lifted(reshaped):
    """A broadcast output is handed on expanded to the run's samples, so its gradient comes per
    sample; where the model cannot take the expanded tensor, its module goes to the parent."""
    model = Positions(reshaped).eval()
    x = torch.randn(N, 5, 4)
    eng, got, ref = _rows(model, (x, _probe(x)))
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert (model.pos in eng._hooked.plan.layers) == (not reshaped)
    assert bool(eng._hooked.lifts) == reshaped, eng._hooked.lifts
    assert max_relative_error(got, ref) <= TOL


def test_a_first_run_of_one_sample_does_not_fix_the_layout():
    """The first run holds one sample (class 0; class 1 is bigger than half a batch and goes
    alone): there every ``[1, ...]`` argument looks per-sample; later runs must not be held to it."""
    model = Positions(reshaped=False).eval()
    x = torch.randn(N, 5, 4)
    y = torch.tensor([0, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 5])
    eng, got, ref = _rows(model, (x, y))
    _on_hooks(eng)
    assert model.pos in eng._hooked.plan.layers
    assert max_relative_error(got, ref) <= TOL


class TableShift(nn.Module):
    """A unit with a constant argument (a ``[6, 8]`` table) besides its per-sample input."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(8))

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return (h + table.mean(0)) * self.weight


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.shift = TableShift()
        self.head = nn.Linear(8, C)
        self.register_buffer("table", torch.randn(6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shift(self.inp(x), table=self.table)))


def test_a_constant_the_size_of_a_run_is_not_taken_for_per_sample():
    """Runs of 7 then 6 samples: in the second, the table's 6 rows look like one per sample; the
    layout seen on the first run (6 != 7: a constant) is kept."""
    model = WithTable().eval()
    x = torch.randn(N, 4)
    y = torch.tensor([0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 5, 5, 5])
    eng, got, ref = _rows(model, (x, y))
    _on_hooks(eng)
    assert model.shift in eng._hooked.plan.units
    assert max_relative_error(got, ref) <= TOL


def test_a_constant_the_size_of_the_first_run_is_caught_by_the_one_sample_check():
    """The first run holds 6 samples, the table's row count: the table looks per-sample there.
    The unit alone on one sample then gives another output than captured, so its parameters go
    to the parent (the whole model, whose only argument is the input)."""
    model = WithTable().eval()
    x = torch.randn(N, 4)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 5, 5])
    eng, got, ref = _rows(model, (x, y))
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert any("alone on one sample" in lift for lift in eng._hooked.lifts), eng._hooked.lifts
    assert model.shift not in eng._hooked.plan.layers and model in eng._hooked.plan.units
    assert max_relative_error(got, ref) <= TOL


# --- unit computers, loss scale -------------------------------------------------------------


def test_a_registered_unit_computer_is_used_for_its_type_and_subclasses():
    calls: list[str] = []

    @register_unit_computer(Scale)
    def counted(module, args, kwargs, grad_outputs, grid, kinds):
        calls.append(type(module).__name__)
        return module_class_grads(module, args, kwargs, grad_outputs, grid, kinds)

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_unit_computer(Scale)(counted)
        model = FrozenScale().eval()
        x = torch.randn(N, 4)
        eng, got, ref = _rows(model, (x, _probe(x)))
    finally:
        UNIT_COMPUTERS.pop(Scale, None)
    _on_hooks(eng)
    assert calls and set(calls) == {"Scale"}
    # Looked up along the type's bases: the one computer for nn.RNNBase (the class-batched
    # recurrent rule) serves LSTM, GRU and RNN.
    assert unit_computer_for(Scale(2)) is module_class_grads
    assert unit_computer_for(nn.LSTM(2, 2)) is recurrent_unit and unit_computer_for(nn.GRU(2, 2)) is recurrent_unit
    assert max_relative_error(got, ref) <= TOL


def test_a_unit_vmap_cannot_batch_is_done_class_by_class():
    """A module with data-dependent control flow inside: its VJP cannot be vmapped, so its
    classes go one by one on that module alone (the rest of the model stays on the hook path)."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h * self.weight if bool((h > 0).any()) else h

    model = nn.Sequential(nn.Linear(4, 8), Gate(), nn.Tanh(), nn.Linear(8, C)).eval()
    x = torch.randn(N, 4)
    eng, got, ref = _rows(model, (x, _probe(x)))
    _on_hooks(eng)
    assert model[1] in choices.VMAP_REFUSED
    assert any("class by class" in note for note in eng.stats.notes), eng.stats.notes
    assert max_relative_error(got, ref) <= TOL


# fp16 rows against the float64 reference: engine_cases.LOW_PRECISION_TOLERANCE (about 20u).
FP16_TOL = 1e-2


def test_units_undo_the_fp16_loss_scale():
    model = RawParams().eval()
    x = torch.randn(40, 5, 4)
    labels = torch.arange(C).repeat_interleave(8)[:40]
    eng, got, ref = _rows(model, (x, labels), precision="fp16")
    _on_hooks(eng)
    blocks = eng.compute(range(C))
    assert bool((blocks.loss_scale[blocks.count > 0] == 2.0**16).all())
    assert max_relative_error(got, ref) <= FP16_TOL


# --- the last resort and the path line ------------------------------------------------------


class Branchy(nn.Module):
    """Control flow on the data (vmap cannot run it) over plain layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.relu(h) if bool((h > 0).any()) else h)


def test_the_last_resort_does_one_forward_per_pack_and_a_backward_per_class(caplog):
    """Hooks on every module rule out the hook path, vmap cannot run the control flow: each pack
    (at most a batch of samples) goes through one forward, then a backward per class."""
    model = Branchy().eval()
    x = torch.randn(N, 4)
    y = _probe(x)
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        with caplog.at_level(logging.INFO, logger="classgrad.workers.engines.partitioned.engine"):
            eng, got, ref = _rows(model, (x, y), group_rows=2)
    finally:
        handle.remove()
    assert eng._hooked is None and eng._vmap is None
    # Sizes 3,1,3,3,0,3 in batches of 8: packs {1, 3} (4 samples) and 2 x {3, 3}; class 4 is empty.
    assert eng.stats.forwards == 3 and eng.stats.backwards == 5
    assert max_relative_error(got, ref) <= TOL
    # One line for the whole engine (its groups of 2 rows included), with the short reason.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("partitioned")]
    path_notes = [n for n in eng.stats.notes if not n.startswith(FALLBACK)]
    assert lines == path_notes and len(lines) == 1, lines
    assert "one forward per pack" in lines[0] and "vmap abandoned (" in lines[0]
    assert len(lines[0]) <= 300 and "\n" not in lines[0]
    # Each fallback also said once on its own, with how much slower its path is (issue 25).
    fallbacks = [n for n in eng.stats.notes if n.startswith(FALLBACK)]
    assert len(fallbacks) == 2 and all("x slower" in n for n in fallbacks), fallbacks


def test_a_layer_its_rule_does_not_apply_to_is_a_unit_and_the_line_says_why():
    """A layer whose registered rule says it does not apply (as Conv2d's for ``padding="same"``)
    is handled by its module's VJP instead."""

    @register_rule(Scale, applies=lambda m: "not for this one")
    def never(module, seen, out):
        raise AssertionError("a rule that does not apply must not run")

    try:
        model = FrozenScale().eval()
        x = torch.randn(N, 4)
        eng, got, ref = _rows(model, (x, _probe(x)))
    finally:
        RULES.pop(Scale, None)
    _on_hooks(eng)
    assert {model.scale, model.fixed} <= set(eng._hooked.plan.units)
    assert "Scale not by its rule (not for this one)" in eng.stats.notes[0], eng.stats.notes
    assert max_relative_error(got, ref) <= TOL


def test_the_path_line_names_rules_and_units_once(caplog):
    model = RawParams().eval()
    x = torch.randn(N, 5, 4)
    with caplog.at_level(logging.INFO, logger="classgrad.workers.engines.partitioned.engine"):
        eng, _, _ = _rows(model, (x, _probe(x)), group_rows=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("partitioned")]
    assert lines == eng.stats.notes and len(lines) == 1, lines
    assert lines[0] == (
        "partitioned: hooks for 4 params (Linear 4); module VJP for 3 (RawParams: scale; Tokens: cls_token, pos_embed)"
    )
