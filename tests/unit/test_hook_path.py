"""The partitioned engine's hook path and its guards: a hooked parameter used outside its layer,
eval-mode BatchNorm, global module hooks, the once-per-model spot check, layers run under
no_grad, either image format, and Hugging Face BERT with a padding mask (module-VJP units for
its embeddings and norm layers); rows always match the reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from classgrad.workers import zoo
from classgrad.workers.engines import choices
from classgrad.workers.gradients import build_engine, per_class_gradients
from tests.support.engine_cases import NUM_CLASSES, WeightUsedOutside, fell_back, max_relative_error
from tests.support.hf_models import hf_probe, tiny_bert, tiny_resnet


def test_a_hooked_parameter_used_outside_its_layer_is_detected():
    """Only a middle class (never one of the two spot-checked rows) is affected by the use of
    ``enc.weight`` outside ``enc``; the engine must notice it in the graph and still return
    exact rows (``enc``'s parameters by a VJP of the module that uses them: the model)."""
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
    assert eng._hooked is not None and eng._hooked.lifts and model in eng._hooked.plan.units


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
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes  # no fallback to vmap
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


class ResidualInPlace(nn.Module):
    """A residual block that adds into a layer's output in place (``h += x``, as Hugging Face's
    ResNet does) and an in-place ReLU on another layer's output."""

    def __init__(self, num_classes: int):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x).relu_()
        out = self.inner(h)
        out += h
        return self.head(out)


def test_only_the_layers_whose_outputs_change_in_place_are_copied():
    model = ResidualInPlace(NUM_CLASSES).eval()
    x, y = zoo.synthetic_probe(NUM_CLASSES, 4, kind="vector", input_shape=(8,), seed=0)
    eng = build_engine(model, (x, y), num_classes=NUM_CLASSES, engine="partitioned")
    got = torch.cat([b.rows for b in eng.iter_blocks(list(range(NUM_CLASSES)))])
    assert eng._hooked is not None  # the fast path itself is under test here
    copies = eng._hooked.copies
    assert copies(model.enc) and copies(model.inner) and not copies(model.head) and not copies.every
    want = per_class_gradients(model, (x, y), num_classes=NUM_CLASSES, engine="reference")
    # fp32 against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("fmt", ["channels_last", "contiguous"])
def test_hook_rows_are_exact_in_either_image_format(fmt, monkeypatch):
    """In either input layout (the rule of ``input_format.image_format`` forced), conv rows from
    hooks match the reference; channels-last batches are then gathered in that layout."""
    from classgrad.workers.engines.partitioned import input_format

    monkeypatch.setattr(input_format, "image_format", lambda model: fmt)
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
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    # The first run's batch is gathered as given and then converted; later runs gather in it.
    # (The plain path of the one-off spot check gathers as the model is given.)
    if fmt == "channels_last":
        assert formats[-1] == torch.channels_last and formats.count(torch.channels_last) >= 2, formats
    else:
        assert torch.channels_last not in formats, formats
    want = per_class_gradients(model, data, num_classes=NUM_CLASSES, engine="reference")
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5


def test_bert_with_padding_cannot_be_vmapped_but_takes_the_hook_path():
    """The whole model under vmap fails on BERT's mask handling (why it used to run a class at a
    time); the units are single modules, which vmap batches."""
    model = tiny_bert(NUM_CLASSES)
    x, y = hf_probe("bert", NUM_CLASSES, 2)
    with pytest.raises(Exception):  # noqa: B017, PT011 - any vmap refusal
        torch.func.vmap(lambda b: model(**b).logits)({k: v.view(2, -1, v.shape[-1]) for k, v in x.items()})
    choices.clear()
    eng = build_engine(model, (x, y), num_classes=NUM_CLASSES, engine="partitioned", batch_size=8)
    got = eng.compute(range(NUM_CLASSES)).rows
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert not choices.VMAP_REFUSED and not eng._hooked.lifts
    want = build_engine(copy.deepcopy(model).double(), (x, y), num_classes=NUM_CLASSES, engine="reference")
    # fp32 against the float64 reference: a few float32 roundoffs over a 2-layer transformer.
    assert max_relative_error(got, want.compute(range(NUM_CLASSES)).rows) <= 1e-5


def test_image_inputs_inside_a_dict_take_the_image_format_too():
    """A Hugging Face image model's ``pixel_values`` (a dict batch) follow the rule of
    ``input_format.image_format`` as a bare image batch does: the hook path's convolutions run
    channels-last; rows exact."""
    model = tiny_resnet(NUM_CLASSES, seed=3)
    x, y = hf_probe("resnet", NUM_CLASSES, per_class=3, seed=4)
    data = [{"pixel_values": x[i], "labels": y[i]} for i in range(len(y))]
    layouts = []
    stem = model.resnet.embedder.embedder.convolution
    stem.register_forward_pre_hook(
        lambda m, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine="partitioned", batch_size=8)
    got = eng.compute(range(NUM_CLASSES)).rows
    assert eng._hooked is not None and not fell_back(eng), eng.stats.notes
    assert any(layouts), layouts  # (the one-off spot check's plain path runs as the model is given)
    want = per_class_gradients(model, data, num_classes=NUM_CLASSES, engine="reference")
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5


def test_a_step_weighted_run_keeps_an_empty_class_row_zero():
    """A training step's class weights are divided out of the finished rows: a class with no
    samples in the run (weight 0 here) keeps its zero row, not 0 x inf; the others are their
    own rows, and the step's gradient is the weighted objective's."""
    from classgrad.workers.engines.base import StepGrads

    torch.manual_seed(2)
    y = torch.tensor([0, 0, 1, 2, 2, 2, 4, 5])  # class 3 has no samples
    x = torch.randn(len(y), 8)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, NUM_CLASSES)).eval()
    classes = list(range(6))
    counts = torch.bincount(y, minlength=6).tolist()
    eng = build_engine(model, (x, y), num_classes=NUM_CLASSES, engine="partitioned")
    eng.step = StepGrads({c: counts[c] / len(y) for c in classes})
    got = torch.cat([b.rows for b in eng.iter_blocks(classes)])
    want = per_class_gradients(model, (x, y), num_classes=NUM_CLASSES, classes=classes, engine="reference")
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # fp32 engines against the fp32 reference on a tiny model: summation order only.
    assert max_relative_error(got, want) <= 1e-5
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])
    # The rules' sums against autograd's: fp32 roundings.
    torch.testing.assert_close(eng.step.grads, grads, rtol=1e-5, atol=1e-6)
