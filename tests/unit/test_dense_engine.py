"""The dense engine beyond the numbers: one forward per micro-batch, rows in blocks (measured
block size, autograd graphs for single rows), and rows through the final Linear layer (the head
basis, per-column VJPs from the head's input) with the conditions that rule each path out."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from classgrad.workers.engines import choices, dense_engine
from classgrad.workers.gradients import build_engine, per_class_gradients
from tests.support.engine_cases import (
    BATCH_SIZE,
    MODEL_CASES,
    NARROW_HEAD_MODELS,
    NUM_CLASSES,
    engine_for,
    log_softmax_mean,
    max_relative_error,
    probe_data,
    reference_rows,
)

# --- one forward per micro-batch, rows in blocks -------------------------------------------


class ForwardCounter:
    """Counts forward calls of a model and keeps a weak reference to the last output."""

    def __init__(self, model: nn.Module):
        self.calls = 0
        self.last_output: weakref.ref | None = None
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.calls += 1
        self.last_output = weakref.ref(output)


@pytest.mark.parametrize("batch_size,micro_batches", [(1000, 1), (5, None)])
@pytest.mark.parametrize("loss_case", ["logit", "bce", "custom_dense"])
def test_dense_rows_come_from_one_forward_per_micro_batch_in_several_blocks(loss_case, batch_size, micro_batches):
    eng = engine_for("cnn", loss_case, "dense", block_rows=2)
    eng.probe.batch_size = batch_size
    counter = ForwardCounter(eng.model)
    blocks = list(eng.iter_blocks(range(NUM_CLASSES)))
    expected_forwards = micro_batches or eng.probe.num_micro_batches
    assert expected_forwards == (1 if batch_size == 1000 else 3)
    assert counter.calls == expected_forwards == eng.stats.forwards
    # 6 rows in blocks of 2: three batched VJPs per micro-batch, all on the same graph; logit
    # and bce (per-column losses) start them at the head's input, after one more VJP that gives
    # the loss's gradient at the outputs.
    assert eng.stats.backwards == (3 + (loss_case in ("logit", "bce"))) * expected_forwards
    if micro_batches == 1:
        assert [len(b) for b in blocks] == [2, 2, 2]  # streamed as computed
    del blocks
    gc.collect()
    assert counter.last_output is not None and counter.last_output() is None, "graph outlived its rows"


def test_dense_block_size_is_measured_when_not_given():
    eng = engine_for("mlp", "logit", "dense")
    eng.probe.batch_size = 1000
    eng.compute(range(NUM_CLASSES))
    assert eng.block_rows in (1, 2, 4)  # at most the 6 rows asked for, a power of two
    assert any("block_rows" in note for note in eng.stats.notes)


@pytest.mark.parametrize("model_case", ["mlp", "cnn", "bn_train"])
def test_dense_single_row_vjps_use_autograd_graphs_and_match_the_reference(model_case):
    """Block size 1 runs one torch.autograd.grad per row (less per-call overhead than torch.func,
    whose vmap only pays off for batched rows); the rows are the same."""
    # A loss that sees every output column (no head graph): VJPs through the whole model.
    eng = engine_for(model_case, "custom_dense", "dense", block_rows=1)
    eng.probe.batch_size = 5  # several micro-batches: rows accumulated over graphs
    rows = eng.compute(range(NUM_CLASSES)).rows
    # The float64 reference's contract (see test_engines): a few float32 roundoffs.
    assert max_relative_error(rows, reference_rows(model_case, "custom_dense")[0]) <= 1e-6
    with eng.selected_grads():
        assert isinstance(eng._graph(next(eng.probe.micro_batches())), dense_engine._AutogradGraph)


def test_a_measured_block_size_of_one_is_reused_with_autograd_graphs(monkeypatch):
    monkeypatch.setattr(dense_engine, "BLOCK_CANDIDATES", (1,))  # the measurement can only pick 1
    monkeypatch.setattr(choices, "BLOCK_ROWS", {})
    first = engine_for("mlp", "custom_dense", "dense")  # VJPs through the whole model
    first.probe.batch_size = 1000
    first.compute(range(NUM_CLASSES))
    assert first.block_rows == 1
    later = build_engine(first.model, first.probe, num_classes=NUM_CLASSES, loss=log_softmax_mean, engine="dense")
    with later.selected_grads():
        assert isinstance(later._graph(next(later.probe.micro_batches())), dense_engine._AutogradGraph)
    assert later.block_rows == 1
    assert any("measured earlier" in note for note in later.stats.notes)


# --- dense rows through the final Linear layer (classgrad.workers.engines.head) ----------------------

HEAD_NOTE = "through the final Linear layer"


def _head_engine(model, data, **options):
    return build_engine(model, data, num_classes=NUM_CLASSES, loss="logit", engine="dense", **options)


@pytest.mark.parametrize("batch_size", [1000, 5])
@pytest.mark.parametrize("selection", ["all", "body", "head"])
@pytest.mark.parametrize("model_case", sorted(NARROW_HEAD_MODELS))
def test_linear_loss_rows_go_through_the_head_and_match_the_reference(model_case, selection, batch_size):
    """F features into the head (< C classes): F VJPs per micro-batch (plus one for the loss's
    sample weights) replace C, whichever parameters a row holds, over one or several
    micro-batches, BatchNorm in train mode included."""
    model = MODEL_CASES[model_case].build()
    head_name = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    options = {"all": {}, "body": {"exclude": [f"{head_name}.*"]}, "head": {"params": [f"{head_name}.*"]}}[selection]
    data = probe_data(model_case, "logit")
    eng = _head_engine(model, data, batch_size=batch_size, **options)
    got = eng.compute(range(NUM_CLASSES))
    assert any(HEAD_NOTE in n for n in eng.stats.notes), eng.stats.notes
    features = dict(model.named_modules())[head_name].in_features
    vjps = 0 if selection == "head" else features
    assert eng.stats.backwards == (vjps + 1) * eng.probe.num_micro_batches
    want = build_engine(
        copy.deepcopy(model).double(),
        data,
        num_classes=NUM_CLASSES,
        loss="logit",
        engine="reference",
        batch_size=batch_size,
        **options,
    ).compute(range(NUM_CLASSES))
    # The float64 reference's contract (see test_engines): a few float32 roundoffs.
    assert max_relative_error(got.rows, want.rows) <= 1e-6
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=1e-6, atol=1e-7)


def test_the_head_basis_is_kept_for_later_calls_until_a_parameter_changes():
    """An actor asks one engine for shard after shard: the basis does not depend on the classes,
    so later shards cost no forward pass, until the model's parameters change."""
    model = MODEL_CASES["narrow_mlp"].build()
    data = probe_data("narrow_mlp", "logit")
    eng = _head_engine(model, data, batch_size=5)
    first = eng.compute([0, 1, 2]).rows
    forwards = eng.stats.forwards
    later = eng.compute([3, 4, 5, 0]).rows
    assert eng.stats.forwards == forwards  # no forward pass for the second shard
    # The same row from a block of 4 and a block of 3: the basis matmul's blocking depends on the
    # row count and differs between CPUs (AMD vs Intel BLAS), so float32 roundoff, not bitwise.
    torch.testing.assert_close(later[3], first[0], rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    changed = eng.compute([0]).rows
    assert eng.stats.forwards == 2 * forwards
    want = per_class_gradients(
        model, data, num_classes=NUM_CLASSES, loss="logit", engine="reference", batch_size=5, classes=[0]
    )
    # fp32 against the fp32 reference: summation order only.
    assert max_relative_error(changed, want) <= 1e-5


class _ScaledHead(nn.Module):
    """Logits scaled after the final Linear layer: the output is not the head's own."""

    def __init__(self):
        super().__init__()
        self.body = MODEL_CASES["narrow_mlp"].build()

    def forward(self, x):
        return self.body(x) * 2.0


class _TiedHead(nn.Module):
    """The head's weight also used below it (h depends on W): rows through the head would miss
    that path."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 5)
        self.head = nn.Linear(5, NUM_CLASSES)

    def forward(self, x):
        h = torch.relu(self.enc(x)) + 0.1 * (x[:, :NUM_CLASSES] @ self.head.weight)
        return self.head(h)


GRAPH_NOTE = "backward starts at the input of the final Linear layer"


@pytest.mark.parametrize("case", ["bce", "custom_dense", "fp16", "scaled_output", "tied_head", "wide_head"])
def test_rows_take_the_next_path_when_a_head_condition_fails(case):
    """Each condition, broken once: the engine notes why and takes the next path (basis, then
    per-row VJPs from the head's input, then per-row VJPs through the whole model), rows still
    matching the reference."""
    model = {"scaled_output": _ScaledHead, "tied_head": _TiedHead}.get(case, MODEL_CASES["narrow_mlp"].build)()
    if case == "wide_head":
        model = MODEL_CASES["mlp"].build()  # 16 features for 6 classes: a basis would not pay
    model = model.eval()
    loss = {"bce": "bce", "custom_dense": log_softmax_mean}.get(case, "logit")
    data = probe_data("narrow_mlp", "bce" if case == "bce" else "logit", samples_per_class=8)
    precision = "fp16" if case == "fp16" else "fp32"
    eng = build_engine(
        model, data, num_classes=NUM_CLASSES, loss=loss, engine="dense", precision=precision, batch_size=5
    )
    got = eng.compute(range(NUM_CLASSES)).rows
    notes = " | ".join(eng.stats.notes)
    assert HEAD_NOTE not in notes
    reason = {
        "bce": "not declared linear in outputs",
        "custom_dense": "not declared per column",
        "fp16": "fp16 loss scaling",
        "scaled_output": "not the output of one",
        "tied_head": "also used below it",
        "wide_head": "at least as many input features",
    }[case]
    assert reason in notes, notes
    # bce and a wide head still start each row's backward at the head's input; the others cannot.
    assert (GRAPH_NOTE in notes) == (case in ("bce", "wide_head")), notes
    want = (
        build_engine(
            copy.deepcopy(model).double(), data, num_classes=NUM_CLASSES, loss=loss, engine="reference", batch_size=5
        )
        .compute(range(NUM_CLASSES))
        .rows
    )
    # fp32: a few roundoffs (test_engines' contract); fp16: test_engines' low-precision bound.
    assert max_relative_error(got, want) <= (1e-2 if case == "fp16" else 1e-6)


def test_a_head_path_found_not_to_apply_is_not_tried_again_on_that_model():
    """Finding that the output is not the head's own costs a forward pass; a later engine on the
    same model (an estimate after a job, the next benchmark run) knows it without one."""
    model = _ScaledHead().eval()
    data = probe_data("narrow_mlp", "logit")

    def forwards() -> int:
        eng = build_engine(model, data, num_classes=NUM_CLASSES, loss="logit", engine="dense", batch_size=1000)
        eng.compute(range(NUM_CLASSES))
        assert any("not the output of one" in n for n in eng.stats.notes), eng.stats.notes
        return eng.stats.forwards

    first, later = forwards(), forwards()
    # One micro-batch: the first engine tried the basis and the head graph (a forward each), then
    # ran its rows through the whole model; the later one runs only that forward.
    assert (first, later) == (3, 1)


@pytest.mark.parametrize("block_rows", [1, 3])
@pytest.mark.parametrize("selection", ["all", "body", "head"])
@pytest.mark.parametrize("model_case", ["mlp", "bn_train", "transformer"])
def test_per_column_rows_start_at_the_head_input_and_match_the_reference(model_case, selection, block_rows):
    """bce (L_c sees only output column c): each row's backward starts at the head's input with
    the rank-one cotangent a[:, c] W[c]; the head's columns are written directly. Single and
    batched VJPs, over several micro-batches, any parameter selection."""
    model = MODEL_CASES[model_case].build()
    head_name = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    options = {"all": {}, "body": {"exclude": [f"{head_name}.*"]}, "head": {"params": [f"{head_name}.*"]}}[selection]
    data = probe_data(model_case, "bce")
    eng = build_engine(
        model,
        data,
        num_classes=NUM_CLASSES,
        loss="bce",
        engine="dense",
        batch_size=BATCH_SIZE,
        block_rows=block_rows,
        **options,
    )
    got = eng.compute(range(NUM_CLASSES))
    assert any(GRAPH_NOTE in n for n in eng.stats.notes), eng.stats.notes
    want = build_engine(
        copy.deepcopy(model).double(),
        data,
        num_classes=NUM_CLASSES,
        loss="bce",
        engine="reference",
        batch_size=BATCH_SIZE,
        **options,
    ).compute(range(NUM_CLASSES))
    # The float64 reference's contract (see test_engines): a few float32 roundoffs.
    assert max_relative_error(got.rows, want.rows) <= 1e-6
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=1e-6, atol=1e-7)
