"""Every engine x loss kind x zoo model against the float64 reference engine; the public
``per_class_gradients``."""

from __future__ import annotations

import copy

import pytest
import torch

from classgrad.errors import InputError
from classgrad.workers import zoo
from classgrad.workers.gradients import build_engine, per_class_gradients
from classgrad.workers.layout import ParamLayout
from tests.support.engine_cases import (
    EMPTY_CLASS,
    LOSS_CASES,
    LOW_PRECISION_TOLERANCE,
    MODEL_CASES,
    NUM_CLASSES,
    PARTITIONED_LOSSES,
    applicable,
    engine_for,
    max_relative_error,
    reference_rows,
    zero_rows,
)

ENGINE_CASES = ["partitioned", "dense", "reference"]


MATRIX = [
    pytest.param(m, loss, e, id=f"{e}-{loss}-{m}")
    for m in MODEL_CASES
    for loss in LOSS_CASES
    for e in ENGINE_CASES
    if applicable(m, loss, e)
]


@pytest.mark.parametrize("model_case,loss_case,engine", MATRIX)
def test_fp32_engine_matches_float64_reference(model_case, loss_case, engine):
    ref_rows, ref_loss = reference_rows(model_case, loss_case)
    eng = engine_for(model_case, loss_case, engine)
    block = eng.compute(range(NUM_CLASSES))
    assert block.rows.dtype == torch.float32
    # float32 has a unit roundoff of 6e-8; these small models sum at most a few hundred terms
    # per entry, so the normwise error stays within a few tens of roundoffs. The summation order
    # follows the thread count (1.08e-6 seen for bce on strided_inplace with one torch thread,
    # under 1e-6 with two): 2e-6 is the contract on any machine.
    assert max_relative_error(block.rows, ref_rows) <= 2e-6
    # Zero rows are structural (a class with no samples), never a rounding accident.
    assert torch.equal(zero_rows(block.rows), zero_rows(ref_rows))
    # L_c in float32 against float64: a few roundoffs of a sum of O(10) terms.
    torch.testing.assert_close(block.loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-7)
    assert torch.equal(block.classes, torch.arange(NUM_CLASSES))


@pytest.mark.parametrize("loss_case", sorted(PARTITIONED_LOSSES))
def test_empty_class_gives_zero_row_and_zero_count(loss_case):
    block = engine_for("mlp", loss_case, "partitioned").compute([EMPTY_CLASS, 0])
    assert bool((block.rows[0] == 0).all()) and int(block.count[0]) == 0 and float(block.loss[0]) == 0.0
    assert int(block.count[1]) > 0 and bool((block.rows[1] != 0).any())


def test_rows_come_in_the_order_asked_for():
    eng = engine_for("cnn", "cross_entropy", "partitioned")
    full = eng.compute(range(NUM_CLASSES)).rows
    order = [5, 0, 3, 3, 1]
    part = eng.compute(order)
    assert part.classes.tolist() == order
    # Same arithmetic per class wherever it sits in the request: packing may differ, so allow
    # float32 summation-order differences only.
    torch.testing.assert_close(part.rows, full[order], rtol=1e-5, atol=1e-7)


# --- mixed precision ----------------------------------------------------------------------

# The bounds and why: tests/support/engine_cases.LOW_PRECISION_TOLERANCE (about 20-25 unit roundoffs).

LOW_PRECISION_MATRIX = [
    pytest.param(m, loss, e, p, id=f"{p}-{e}-{loss}-{m}")
    for m in MODEL_CASES
    for loss in ("cross_entropy", "logit")
    for e in ("partitioned", "dense")
    for p in ("fp16", "bf16")
    if applicable(m, loss, e)
]


@pytest.mark.parametrize("model_case,loss_case,engine,precision", LOW_PRECISION_MATRIX)
def test_low_precision_matches_reference(model_case, loss_case, engine, precision):
    # 8 samples per class: per-class averages over more samples keep single ReLU flips small.
    ref_rows, _ = reference_rows(model_case, loss_case, samples_per_class=8)
    block = engine_for(model_case, loss_case, engine, precision=precision, samples_per_class=8).compute(
        range(NUM_CLASSES)
    )
    assert block.rows.dtype == torch.float32 and bool(torch.isfinite(block.rows).all())
    assert max_relative_error(block.rows, ref_rows) <= LOW_PRECISION_TOLERANCE[precision]
    assert torch.equal(zero_rows(block.rows), zero_rows(ref_rows))
    expected_scale = 2.0**16 if precision == "fp16" else 1.0
    computed = block.count > 0  # an empty class's zero row involves no backward and no scale
    assert bool((block.loss_scale[computed] == expected_scale).all())
    assert not bool(block.recomputed.any())


# --- bad input ------------------------------------------------------------------------------


def test_auto_picks_partitioned_only_when_samples_are_independent():
    assert engine_for("cnn", "cross_entropy", "auto").name == "partitioned"
    assert engine_for("bn_eval", "cross_entropy", "auto").name == "partitioned"
    assert engine_for("bn_train", "cross_entropy", "auto").name == "dense"
    assert engine_for("transformer", "custom_partitioned", "auto").name == "partitioned"
    assert engine_for("cnn", "logit", "auto").name == "dense"


def test_partitioned_refuses_batch_coupled_models_and_dense_losses():
    with pytest.raises(InputError, match="BatchNorm2d in train mode"):
        engine_for("bn_train", "cross_entropy", "partitioned")
    with pytest.raises(InputError, match="treats samples independently"):
        engine_for("bn_no_stats", "cross_entropy", "partitioned")
    assert engine_for("bn_no_stats", "cross_entropy", "auto").name == "dense"
    with pytest.raises(InputError, match="'logit' is dense"):
        engine_for("mlp", "logit", "partitioned")


def test_unknown_engine_lists_choices():
    with pytest.raises(InputError, match="choices: auto, dense, partitioned, reference"):
        engine_for("mlp", "cross_entropy", "fastest")


def test_batchnorm_running_stats_are_left_untouched():
    eng = engine_for("bn_train", "cross_entropy", "dense")
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    eng.compute(range(NUM_CLASSES))
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --- the public API ------------------------------------------------------------------------


def test_per_class_gradients_api():
    model = zoo.small_cnn(NUM_CLASSES).eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 8, 8))
    full = per_class_gradients(model, data, num_classes=NUM_CLASSES)
    assert full.dtype == torch.float32 and full.shape == (NUM_CLASSES, sum(p.numel() for p in model.parameters()))
    some = per_class_gradients(
        model, data, num_classes=NUM_CLASSES, classes=[4, 1], params=["head.2.*"], engine="dense"
    )
    layout = ParamLayout.from_model(model)
    start = layout.slot("head.2.weight").offset
    # Same rows by another engine and a column subset: float32 summation order only.
    torch.testing.assert_close(some, full[[4, 1], start:], rtol=1e-5, atol=1e-7)


def _dropout_bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(16, NUM_CLASSES),
    )


def test_per_class_gradients_runs_in_eval_mode_by_default_and_restores_each_modules_mode():
    """A model fresh from a factory is in train mode; the API computes in eval mode, as a job does,
    and leaves every module's own mode as it found it (here one submodule was already in eval)."""
    model = _dropout_bn_mlp()  # train mode: BatchNorm batch statistics and dropout would change the rows
    model[1].eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(8,), seed=4)
    got = per_class_gradients(model, data, num_classes=NUM_CLASSES)
    assert model.training and not model[1].training and model[3].training
    reference = copy.deepcopy(model).eval().double()
    want = per_class_gradients(reference, data, num_classes=NUM_CLASSES, engine="reference")
    # fp32 against the float64 reference of the same eval-mode model: a few roundoffs (see above).
    assert max_relative_error(got, want) <= 2e-6


def test_per_class_gradients_in_train_mode_says_dropout_makes_rows_depend_on_the_seed(caplog):
    model = _dropout_bn_mlp().eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(8,), seed=4)
    with caplog.at_level("WARNING", logger="classgrad.workers.gradients"):
        per_class_gradients(model, data, num_classes=NUM_CLASSES, mode="train", engine="dense")
    assert any("dropout is active" in r.getMessage() for r in caplog.records)
    assert not any(m.training for m in model.modules())  # put back in eval
    with pytest.raises(InputError, match="mode 'bogus' is unknown"):
        per_class_gradients(model, data, num_classes=NUM_CLASSES, mode="bogus")


def test_per_class_gradients_progress_bar_counts_rows_and_leaves_them_unchanged(capsys):
    """progress=True draws a tqdm bar on stderr that ends at the number of rows; progress=False and
    the default (stderr is not a terminal under pytest) draw nothing; the rows are the same.
    An MLP, because its rows are bit-reproducible call to call on CPU (the CNN's conv backward is not)."""
    model = zoo.mlp(NUM_CLASSES, in_features=8).eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(8,), seed=4)
    classes = [5, 0, 3, 1]
    n = len(classes)
    capsys.readouterr()
    with_bar = per_class_gradients(model, data, num_classes=NUM_CLASSES, classes=classes, progress=True)
    err = capsys.readouterr().err
    assert f"{n}/{n}" in err and "rows" in err, err
    without = per_class_gradients(model, data, num_classes=NUM_CLASSES, classes=classes, progress=False)
    assert capsys.readouterr().err == ""
    default = per_class_gradients(model, data, num_classes=NUM_CLASSES, classes=classes)
    assert capsys.readouterr().err == ""
    # The bar only observes the blocks: same engine, same inputs, bit-identical rows (no tolerance).
    assert torch.equal(with_bar, without) and torch.equal(with_bar, default)


def test_partitioned_blocks_written_into_a_given_output_are_views_of_it():
    """``iter_blocks(out=...)`` (what ``per_class_gradients`` uses on the CPU): every row lands in
    ``out`` once, blocks are views of it, and the rows equal the engine's own blocks."""
    model = zoo.mlp(NUM_CLASSES, in_features=6, hidden=8).eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="vector", input_shape=(6,), seed=2)
    eng = build_engine(model, data, num_classes=NUM_CLASSES, engine="partitioned", batch_size=4, group_rows=3)
    want = torch.cat([b.rows for b in eng.iter_blocks(range(NUM_CLASSES))])
    out = torch.full((NUM_CLASSES, eng.layout.dim), float("nan"))
    blocks = list(eng.iter_blocks(range(NUM_CLASSES), out=out))
    assert len(blocks) > 1 and all(b.rows.data_ptr() == out[i * 3].data_ptr() for i, b in enumerate(blocks))
    assert torch.equal(out, want)  # the same computation, the same order: bitwise
    with pytest.raises(ValueError, match="out must be"):
        next(eng.iter_blocks(range(NUM_CLASSES), out=out[:-1]))
    # per_class_gradients takes that route on the CPU and gives the same rows.
    assert torch.equal(
        per_class_gradients(model, data, num_classes=NUM_CLASSES, batch_size=4, engine="partitioned"), want
    )
