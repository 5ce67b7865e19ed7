"""Engine behaviour beyond the numbers: blocks and graphs, fp16 overflow, bad input, the API."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import weakref

import pytest
import torch
from torch import nn

from classgrad.service.config import BUILTIN_LOSS_KINDS
from classgrad.service.errors import InputError, RowOverflowError
from tests.support.engine_cases import (
    BATCH_SIZE, MODEL_CASES, NARROW_HEAD_MODELS, NUM_CLASSES, WeightUsedOutside, engine_for, log_softmax_mean,
    max_relative_error, probe_data, reference_rows,
)
from classgrad.workers import zoo
from classgrad.workers.engines import build_engine, dense, per_class_gradients
from classgrad.workers.runtime.factory import build_model, load_checkpoint, preflight
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import LOSSES, create_loss, partitioned_loss

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
        assert isinstance(eng._graph(next(eng.probe.micro_batches())), dense._AutogradGraph)


def test_a_measured_block_size_of_one_is_reused_with_autograd_graphs(monkeypatch):
    monkeypatch.setattr(dense, "BLOCK_CANDIDATES", (1,))  # the measurement can only pick 1
    monkeypatch.setattr(dense, "_BLOCK_ROWS", {})
    first = engine_for("mlp", "custom_dense", "dense")  # VJPs through the whole model
    first.probe.batch_size = 1000
    first.compute(range(NUM_CLASSES))
    assert first.block_rows == 1
    later = build_engine(first.model, first.probe, num_classes=NUM_CLASSES, loss=log_softmax_mean, engine="dense")
    with later.selected_grads():
        assert isinstance(later._graph(next(later.probe.micro_batches())), dense._AutogradGraph)
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
    want = build_engine(copy.deepcopy(model).double(), data, num_classes=NUM_CLASSES, loss="logit",
                        engine="reference", batch_size=batch_size, **options).compute(range(NUM_CLASSES))
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
    want = per_class_gradients(model, data, num_classes=NUM_CLASSES, loss="logit", engine="reference",
                               batch_size=5, classes=[0])
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
    eng = build_engine(model, data, num_classes=NUM_CLASSES, loss=loss, engine="dense", precision=precision,
                       batch_size=5)
    got = eng.compute(range(NUM_CLASSES)).rows
    notes = " | ".join(eng.stats.notes)
    assert HEAD_NOTE not in notes
    reason = {"bce": "not declared linear in outputs", "custom_dense": "not declared per column",
              "fp16": "fp16 loss scaling", "scaled_output": "not the output of one",
              "tied_head": "also used below it", "wide_head": "at least as many input features"}[case]
    assert reason in notes, notes
    # bce and a wide head still start each row's backward at the head's input; the others cannot.
    assert (GRAPH_NOTE in notes) == (case in ("bce", "wide_head")), notes
    want = build_engine(copy.deepcopy(model).double(), data, num_classes=NUM_CLASSES, loss=loss,
                        engine="reference", batch_size=5).compute(range(NUM_CLASSES)).rows
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
    eng = build_engine(model, data, num_classes=NUM_CLASSES, loss="bce", engine="dense", batch_size=BATCH_SIZE,
                       block_rows=block_rows, **options)
    got = eng.compute(range(NUM_CLASSES))
    assert any(GRAPH_NOTE in n for n in eng.stats.notes), eng.stats.notes
    want = build_engine(copy.deepcopy(model).double(), data, num_classes=NUM_CLASSES, loss="bce",
                        engine="reference", batch_size=BATCH_SIZE, **options).compute(range(NUM_CLASSES))
    # The float64 reference's contract (see test_engines): a few float32 roundoffs.
    assert max_relative_error(got.rows, want.rows) <= 1e-6
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=1e-6, atol=1e-7)


# --- fp16: only the rows that overflow are recomputed -------------------------------------

HOT_CLASSES = [1, 4]
CLASS_FACTOR = torch.ones(NUM_CLASSES)
CLASS_FACTOR[HOT_CLASSES] = 2.0**8


@partitioned_loss
def hot_logit(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean own-class logit, 256x larger for the hot classes: their fp16 gradients overflow at a
    scale the other classes take easily."""
    return outputs.gather(1, labels[:, None]).squeeze(1) * CLASS_FACTOR.to(outputs.device)[labels]


def _hot_engine(engine: str, **options):
    data = zoo.synthetic_probe(NUM_CLASSES, 4, kind="vector", input_shape=(8,), seed=3)
    return build_engine(zoo.mlp(NUM_CLASSES, in_features=8, hidden=16).eval(), data, num_classes=NUM_CLASSES,
                        loss=hot_logit, engine=engine, batch_size=8, **options)


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_fp16_recomputes_exactly_the_overflowing_rows(engine):
    from classgrad.workers.amp import PrecisionPolicy

    # 2^12 / 4 samples = 1024 at the logits: fine for ordinary classes; x256 overflows fp16 (max 65504).
    policy = PrecisionPolicy("fp16", init_scale=2.0**12)
    block = _hot_engine(engine, precision=policy).compute(range(NUM_CLASSES))
    truth = _hot_engine("reference").compute(range(NUM_CLASSES)).rows
    assert sorted(block.recomputed.nonzero().squeeze(1).tolist()) == HOT_CLASSES
    assert bool((block.loss_scale[HOT_CLASSES] < 2.0**12).all())
    cold = [c for c in range(NUM_CLASSES) if c not in HOT_CLASSES]
    assert bool((block.loss_scale[cold] == 2.0**12).all())
    assert bool(torch.isfinite(block.rows).all())
    # fp16 roundoff 4.9e-4 over the 3 layers of the MLP: 1e-2 is 20 roundoffs (see test_engines).
    assert max_relative_error(block.rows, truth) <= 1e-2


@pytest.mark.parametrize("engine", ["partitioned", "dense"])
def test_fp16_row_that_never_becomes_finite_names_its_class(engine):
    from classgrad.workers.amp import PrecisionPolicy

    policy = PrecisionPolicy("fp16", init_scale=2.0**12, min_scale=2.0**12)  # no smaller scale allowed
    # The first block holding a stuck row stops the job, naming that row's class.
    with pytest.raises(RowOverflowError, match=r"class\(es\) \[1\] stay non-finite down to loss scale 4096"):
        _hot_engine(engine, precision=policy).compute(range(NUM_CLASSES))


# --- bad input: one clear error naming the problem ----------------------------------------


def test_model_output_width_must_match_num_classes():
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    for engine in ("partitioned", "dense", "reference"):
        eng = build_engine(zoo.mlp(NUM_CLASSES + 1, in_features=8).eval(), data, num_classes=NUM_CLASSES, engine=engine)
        with pytest.raises(InputError, match=r"model output has shape \(\d+, 7\), expected \(batch, 6\)"):
            eng.compute(range(NUM_CLASSES))
        with pytest.raises(InputError, match="model output has shape"):
            preflight(eng)


def test_labels_outside_the_class_range_are_refused():
    x, y = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    y[3] = NUM_CLASSES
    with pytest.raises(InputError, match=r"labels outside \[0, 6\): sample 3 has label 6"):
        build_engine(zoo.mlp(NUM_CLASSES, in_features=8), (x, y), num_classes=NUM_CLASSES)


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_non_finite_loss_names_the_class(engine):
    x, y = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    x[int((y == 2).nonzero()[0])] = float("nan")
    eng = build_engine(zoo.mlp(NUM_CLASSES, in_features=8).eval(), (x, y), num_classes=NUM_CLASSES,
                       engine=engine, loss="cross_entropy")
    with pytest.raises(InputError, match=r"non-finite loss for class\(es\) \[2"):
        eng.compute(range(NUM_CLASSES))
    with pytest.raises(InputError, match="NaN/Inf in the inputs of probe sample 4"):
        preflight(eng)


def test_parameter_patterns_that_select_nothing_are_refused():
    model = zoo.mlp(NUM_CLASSES)
    with pytest.raises(InputError, match="select no parameters"):
        ParamLayout.from_model(model, include=["encoder.*"])
    with pytest.raises(InputError, match="select no parameters"):
        ParamLayout.from_model(model, exclude=["*"])
    with pytest.raises(InputError, match=r"pattern\(s\) \['nope'\] match no parameter"):
        ParamLayout.from_model(model, include=["0.*", "nope"])


def test_unknown_loss_kind_lists_choices_and_registry_matches_config():
    with pytest.raises(InputError, match="choices: bce, cross_entropy, logit"):
        create_loss("hinge", 10)
    assert set(LOSSES) == set(BUILTIN_LOSS_KINDS)


def test_bce_needs_multi_hot_targets():
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    with pytest.raises(InputError, match=r"multi-hot of shape \[N, 6\]"):
        build_engine(zoo.mlp(NUM_CLASSES, in_features=8), data, num_classes=NUM_CLASSES, loss="bce")


# --- parameter layout and the public API ---------------------------------------------------


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = zoo.mlp(NUM_CLASSES, in_features=8, hidden=16)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_parameters_without_a_path_to_the_loss_give_zero_columns(engine):
    model = WithUnused().eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine=engine)
    rows = eng.compute(range(NUM_CLASSES)).rows
    slot = eng.layout.slot("unused.weight")
    assert bool((rows[:, slot.offset : slot.offset + slot.size] == 0).all())
    assert bool((rows[:, : eng.layout.slot("body.0.weight").size] != 0).any())


def test_layout_order_selection_and_round_trip():
    model = zoo.small_cnn(NUM_CLASSES)
    full = ParamLayout.from_model(model)
    assert full.names == [n for n, _ in model.named_parameters()]
    assert full.dim == sum(p.numel() for p in model.parameters())
    offsets = [s.offset for s in full.slots]
    assert offsets == sorted(offsets) and offsets[0] == 0
    heads = ParamLayout.from_model(model, include=["head.*"], exclude=["*.bias"])
    assert heads.names == ["head.0.weight", "head.2.weight"]
    rows = torch.randn(3, heads.dim)
    views = heads.unflatten(rows)
    assert views["head.2.weight"].shape == (3, NUM_CLASSES, 32)
    assert torch.equal(heads.flatten([views[n] for n in heads.names], batch_dims=1), rows)


def test_frozen_parameters_are_skipped_unless_named():
    model = zoo.mlp(NUM_CLASSES)
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in ParamLayout.from_model(model).names
    assert ParamLayout.from_model(model, include=["0.weight"]).names == ["0.weight"]


def test_per_class_gradients_api():
    model = zoo.small_cnn(NUM_CLASSES).eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 8, 8))
    full = per_class_gradients(model, data, num_classes=NUM_CLASSES)
    assert full.dtype == torch.float32 and full.shape == (NUM_CLASSES, sum(p.numel() for p in model.parameters()))
    some = per_class_gradients(model, data, num_classes=NUM_CLASSES, classes=[4, 1], params=["head.2.*"],
                               engine="dense")
    layout = ParamLayout.from_model(model)
    start = layout.slot("head.2.weight").offset
    # Same rows by another engine and a column subset: float32 summation order only.
    torch.testing.assert_close(some, full[[4, 1], start:], rtol=1e-5, atol=1e-7)


# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoints_load_from_torch_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    source = zoo.mlp(NUM_CLASSES, seed=7)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "w.pt")
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    for name in ("w.pt", "w.safetensors"):
        model = build_model("classgrad.workers.zoo:mlp", {"num_classes": NUM_CLASSES}, str(tmp_path / name), "eval")
        assert not model.training
        for a, b in zip(model.state_dict().values(), source.state_dict().values()):
            assert torch.equal(a, b)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('CLASSGRAD_PWNED', '/nonexistent/pwned')}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_checkpoint_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("CLASSGRAD_PWNED", str(marker))
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"state_dict": _Payload()}))
    with pytest.raises(InputError, match="refused, not a plain weights file"):
        load_checkpoint(zoo.mlp(NUM_CLASSES), str(path))
    assert not marker.exists()


def test_checkpoint_that_does_not_fit_is_refused(tmp_path):
    torch.save(zoo.mlp(NUM_CLASSES, hidden=8).state_dict(), tmp_path / "w.pt")
    with pytest.raises(InputError, match="does not fit the model"):
        load_checkpoint(zoo.small_cnn(NUM_CLASSES), str(tmp_path / "w.pt"))


# --- the hook path's guards ------------------------------------------------------------------


def test_a_hooked_parameter_used_outside_its_layer_is_detected():
    """Only a middle class (never one of the two spot-checked rows) is affected by the use of
    ``enc.weight`` outside ``enc``; the engine must notice it in the graph and still return
    exact rows (from vmap)."""
    torch.manual_seed(1)
    per_class = 4
    y = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    x = torch.randn(len(y), 8) * 0.5
    x[y == NUM_CLASSES // 2, 0] = 4.0
    model = WeightUsedOutside(NUM_CLASSES, gate_above=3.0).eval()
    eng = build_engine(model, (x, y), num_classes=NUM_CLASSES, engine="partitioned")
    got = torch.cat([b.rows for b in eng.iter_blocks(list(range(NUM_CLASSES)))])
    want = per_class_gradients(model, (x, y), num_classes=NUM_CLASSES, engine="reference")
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5
    assert any("hooks" in note for note in eng.stats.notes), eng.stats.notes


def _bn1d_mlp() -> nn.Module:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, NUM_CLASSES)).eval()
    with torch.no_grad():  # running statistics far from (0, 1), so x_hat matters
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.3, 3.0)
    return model


@pytest.mark.parametrize("case", ["bn2d", "bn1d"])
def test_eval_mode_batchnorm_layers_take_the_hook_path(case):
    """A ResNet's BatchNorm weights and biases (eval mode: running statistics) are split by
    class from hooks like Linear and Conv2d ones, exactly."""
    if case == "bn2d":
        model = zoo.bn_cnn(NUM_CLASSES, width=4).eval()
        data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 8, 8), imbalance=1.0, seed=5)
    else:
        model = _bn1d_mlp()
        data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(8,), imbalance=1.0, seed=5)
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine="partitioned", batch_size=8)
    got = eng.compute(range(NUM_CLASSES)).rows
    assert eng._hooked is not None and not eng.stats.notes, eng.stats.notes  # no fallback to vmap
    assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in eng._hooked.layers)
    want = per_class_gradients(model, data, num_classes=NUM_CLASSES, engine="reference")
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5


def test_global_module_hooks_keep_rows_exact():
    """A hook on every module that rescales Linear outputs changes the gradient of every layer
    below it; per-class sums taken at the hooked layers' outputs would miss it, so the engine
    must not use them while such hooks exist."""
    def doubled(module, args, output):
        return output * 2 if isinstance(module, nn.Linear) else None

    x, y = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(8,), seed=2)
    model = zoo.mlp(NUM_CLASSES, in_features=8, hidden=16).eval()
    handle = nn.modules.module.register_module_forward_hook(doubled)
    try:
        got = per_class_gradients(model, (x, y), num_classes=NUM_CLASSES, engine="partitioned")
        want = per_class_gradients(model, (x, y), num_classes=NUM_CLASSES, engine="reference")
    finally:
        handle.remove()
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5


def test_the_hook_check_runs_once_per_model():
    """The spot check of hook rows against the plain path is of the model's structure: a second
    engine on the same model skips it (fewer forwards); a different model object is checked."""
    x, y = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(8,), seed=2)
    model = zoo.mlp(NUM_CLASSES, in_features=8, hidden=16).eval()

    def forwards(m) -> tuple[int, torch.Tensor]:
        eng = build_engine(m, (x, y), num_classes=NUM_CLASSES, engine="partitioned", batch_size=64)
        rows = eng.compute(range(NUM_CLASSES)).rows
        assert eng._hooked is not None  # the hook path is what is under test
        return eng.stats.forwards, rows

    first, rows = forwards(model)
    again, rows_again = forwards(model)
    other, _ = forwards(copy.deepcopy(model))
    assert again == 1 and first == other == 3  # one run of all classes, + 2 spot-checked rows
    assert torch.equal(rows, rows_again)


class FrozenBranch(nn.Module):
    """A layer with selected parameters run under no_grad (a fixed feature branch): its output
    feeds the loss, but its parameters get no gradient."""

    def __init__(self, num_classes: int):
        super().__init__()
        torch.manual_seed(0)
        self.branch = nn.Linear(8, 8)
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            fixed = self.branch(x)
        return self.head(torch.relu(self.enc(x)) + fixed)


def test_a_hooked_layer_run_under_no_grad_gets_zero_rows():
    model = FrozenBranch(NUM_CLASSES).eval()
    x, y = zoo.synthetic_probe(NUM_CLASSES, 4, kind="vector", input_shape=(8,), seed=0)
    eng = build_engine(model, (x, y), num_classes=NUM_CLASSES, engine="partitioned")
    got = torch.cat([b.rows for b in eng.iter_blocks(list(range(NUM_CLASSES)))])
    assert eng._hooked is not None  # the fast path itself is under test here
    want = per_class_gradients(model, (x, y), num_classes=NUM_CLASSES, engine="reference")
    # fp32 against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5
    for name in ("branch.weight", "branch.bias"):
        slot = eng.layout.slot(name)
        assert not got[:, slot.offset : slot.offset + slot.size].any(), name
    slot = eng.layout.slot("enc.weight")
    assert got[:, slot.offset : slot.offset + slot.size].any()


@pytest.mark.parametrize("held", ["tensor", "tuple", "dataset"])
def test_probe_batches_gathered_channels_last_hold_the_same_values(held):
    from classgrad.workers.probe import ProbeSet

    x, y = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 5, 7), seed=1)
    extra = torch.arange(len(y) * 2.0).view(len(y), 2)  # not an image: left as it is
    data = {"tensor": (x, y), "tuple": ((x, extra), y), "dataset": torch.utils.data.TensorDataset(x, y)}[held]
    probe = ProbeSet(data)
    pick = torch.tensor([7, 2, 11, 2, 0])
    got, labels = probe.batch(pick, torch.device("cpu"), torch.float32, memory_format=torch.channels_last)
    images = got[0] if held == "tuple" else got
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert torch.equal(images, x[pick]) and torch.equal(labels, y[pick])
    if held == "tuple":
        assert torch.equal(got[1], extra[pick]) and got[1].is_contiguous()
    plain, _ = probe.batch(pick, torch.device("cpu"), torch.float32)
    assert plain.is_contiguous() if held != "tuple" else plain[0].is_contiguous()


class _AlwaysFormat(dict):
    """Stands in for the partitioned engine's measured image-format choice."""

    def __init__(self, fmt: str):
        super().__init__()
        self.fmt = fmt

    def get(self, key, default=None):
        return self.fmt


@pytest.mark.parametrize("fmt", ["channels_last", "contiguous"])
def test_hook_rows_are_exact_in_either_image_format(fmt, monkeypatch):
    """Whichever input layout the engine settles on (it times both), conv rows from hooks match
    the reference; channels-last batches are then gathered in that layout."""
    from classgrad.workers.engines import partitioned

    monkeypatch.setattr(partitioned, "_INPUT_FORMAT", _AlwaysFormat(fmt))
    model = zoo.small_cnn(NUM_CLASSES, width=4).eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 8, 8), imbalance=1.0, seed=5)
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine="partitioned", batch_size=8)
    formats = []
    batch = eng.probe.batch

    def spy(indices, device, dtype=None, memory_format=None):
        formats.append(memory_format)
        return batch(indices, device, dtype, memory_format=memory_format)

    monkeypatch.setattr(eng.probe, "batch", spy)
    got = eng.compute(range(NUM_CLASSES)).rows
    assert eng._hooked is not None and not eng.stats.notes, eng.stats.notes
    # The first run decides the format (its batch was gathered before); later runs gather in it.
    # (The plain path of the one-off spot check gathers as the model is given.)
    if fmt == "channels_last":
        assert formats[-1] == torch.channels_last and formats.count(torch.channels_last) >= 2, formats
    else:
        assert torch.channels_last not in formats, formats
    want = per_class_gradients(model, data, num_classes=NUM_CLASSES, engine="reference")
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5
