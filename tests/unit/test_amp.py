"""Mixed precision (``classgrad.workers.amp``): the precision policy, the per-row loss-scale
rule (halve only the rows that overflow, recompute only them, give up below ``min_scale``), and
the same rule end to end through the engines."""

from __future__ import annotations

import contextlib

import pytest
import torch

from classgrad.errors import InputError, RowOverflowError
from classgrad.workers import zoo
from classgrad.workers.amp import PrecisionPolicy, rows_with_rescale
from classgrad.workers.gradients import build_engine
from classgrad.workers.losses import partitioned_loss
from tests.support.devices import DEVICES
from tests.support.engine_cases import NUM_CLASSES, max_relative_error

CPU = torch.device("cpu")


def test_policy_scales_only_in_fp16():
    assert PrecisionPolicy("fp16").first_scale == 2.0**16 and PrecisionPolicy("fp16").uses_scaling
    assert PrecisionPolicy("bf16", init_scale=8.0).first_scale == 1.0
    assert PrecisionPolicy().first_scale == 1.0 and not PrecisionPolicy().uses_scaling
    assert isinstance(PrecisionPolicy().autocast(CPU), contextlib.nullcontext)
    with PrecisionPolicy("bf16").autocast(CPU):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"dtype": "fp8"}, "precision.dtype must be fp32, fp16 or bf16, got 'fp8'"),
        (
            {"dtype": "fp16", "init_scale": 4.0, "min_scale": 8.0},
            r"min_scale must be in \(0, init_scale=4.0\], got 8.0",
        ),
        ({"dtype": "fp16", "min_scale": 0.0}, "min_scale must be in"),
    ],
)
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        PrecisionPolicy(**kwargs)


class RowsThatOverflowAbove:
    """A stand-in row computation: row k is ``k + 1`` everywhere when its scale is at most
    ``limits[k]``, inf above it; records which rows each call computed and at what scale."""

    def __init__(self, limits: list[float]):
        self.limits = torch.tensor(limits)
        self.calls: list[tuple[list[int], list[float]]] = []

    def __call__(self, which: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        self.calls.append((which.tolist(), scales.tolist()))
        values = (which + 1).to(torch.float32)
        values[scales > self.limits[which]] = float("inf")
        return values[:, None].expand(-1, 3).clone()


def test_only_the_overflowing_rows_are_halved_and_recomputed():
    compute = RowsThatOverflowAbove([64.0, 16.0, 64.0, 32.0])
    rows, scales, recomputed = rows_with_rescale(
        compute, 4, PrecisionPolicy("fp16", init_scale=64.0), torch.tensor([10, 11, 12, 13]), CPU
    )
    # Row 1 needs two halvings (64 -> 32 -> 16), row 3 one (64 -> 32); rows 0 and 2 none.
    assert compute.calls == [([0, 1, 2, 3], [64.0] * 4), ([1, 3], [32.0, 32.0]), ([1], [16.0])]
    assert scales.tolist() == [64.0, 16.0, 64.0, 32.0]
    assert recomputed.tolist() == [False, True, False, True]
    assert torch.equal(rows, torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3, [4.0] * 3]))


def test_a_row_still_overflowing_below_min_scale_names_its_class():
    compute = RowsThatOverflowAbove([64.0, 1.0, 64.0])
    policy = PrecisionPolicy("fp16", init_scale=64.0, min_scale=8.0)
    with pytest.raises(RowOverflowError, match=r"class\(es\) \[11\] stay non-finite down to loss scale 8.0"):
        rows_with_rescale(compute, 3, policy, torch.tensor([10, 11, 12]), CPU)
    assert [scales for _, scales in compute.calls] == [[64.0] * 3, [32.0], [16.0], [8.0]]  # never below 8


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_loss_scaling_a_non_finite_row_is_an_input_error(dtype):
    compute = RowsThatOverflowAbove([1.0, 0.5])  # row 1 is inf at scale 1
    with pytest.raises(InputError, match=f"non-finite gradient for class 21 in {dtype}"):
        rows_with_rescale(compute, 2, PrecisionPolicy(dtype), torch.tensor([20, 21]), CPU)
    assert len(compute.calls) == 1  # no retry


# --- through the engines: only the rows that overflow are recomputed ----------------------

HOT_CLASSES = [1, 4]
CLASS_FACTOR = torch.ones(NUM_CLASSES)
CLASS_FACTOR[HOT_CLASSES] = 2.0**8


@partitioned_loss
def hot_logit(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean own-class logit, 256x larger for the hot classes: their fp16 gradients overflow at a
    scale the other classes take easily."""
    return outputs.gather(1, labels[:, None]).squeeze(1) * CLASS_FACTOR.to(outputs.device)[labels]


def _hot_engine(engine: str, device: str = "cpu", **options):
    data = zoo.synthetic_probe(NUM_CLASSES, 4, kind="vector", input_shape=(8,), seed=3)
    return build_engine(
        zoo.mlp(NUM_CLASSES, in_features=8, hidden=16).eval(),
        data,
        num_classes=NUM_CLASSES,
        loss=hot_logit,
        engine=engine,
        batch_size=8,
        device=device,
        **options,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_fp16_recomputes_exactly_the_overflowing_rows(engine, device):
    # 2^12 / 4 samples = 1024 at the logits: fine for ordinary classes; x256 overflows fp16 (max 65504).
    policy = PrecisionPolicy("fp16", init_scale=2.0**12)
    block = _hot_engine(engine, device, precision=policy).compute(range(NUM_CLASSES))
    truth = _hot_engine("reference").compute(range(NUM_CLASSES)).rows
    rows, recomputed, loss_scale = block.rows.cpu(), block.recomputed.cpu(), block.loss_scale.cpu()
    assert sorted(recomputed.nonzero().squeeze(1).tolist()) == HOT_CLASSES
    assert bool((loss_scale[HOT_CLASSES] < 2.0**12).all())
    cold = [c for c in range(NUM_CLASSES) if c not in HOT_CLASSES]
    assert bool((loss_scale[cold] == 2.0**12).all())
    assert bool(torch.isfinite(rows).all())
    # fp16 roundoff 4.9e-4 over the 3 layers of the MLP: 1e-2 is 20 roundoffs (see test_engines).
    assert max_relative_error(rows, truth) <= 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["partitioned", "dense"])
def test_fp16_row_that_never_becomes_finite_names_its_class(engine, device):
    policy = PrecisionPolicy("fp16", init_scale=2.0**12, min_scale=2.0**12)  # no smaller scale allowed
    # The first block holding a stuck row stops the job, naming that row's class.
    with pytest.raises(RowOverflowError, match=r"class\(es\) \[1\] stay non-finite down to loss scale 4096"):
        _hot_engine(engine, device, precision=policy).compute(range(NUM_CLASSES))


# --- fp32 is float32 on CUDA: TF32 off while the engine computes ----------------------------


@pytest.fixture
def tf32_settings():
    """torch's TF32 settings, put back after the test (they are process-wide)."""
    b = torch.backends  # set_float32_matmul_precision sets oneDNN's matmuls too
    settings = [b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn, b.mkldnn.matmul]
    saved, legacy = [s.fp32_precision for s in settings], (b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)
    yield
    # torch keeps the older flags apart from the newer settings and refuses to read a mix: both
    # go back, the older first (setting them rewrites the newer ones).
    b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = legacy
    for s, value in zip(settings, saved):
        s.fp32_precision = value


def _tf32_state() -> tuple:
    b = torch.backends
    return b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision


@pytest.mark.parametrize(
    "how",
    [
        "legacy",  # torch.backends.cudnn.allow_tf32 and cuda.matmul.allow_tf32
        "new",  # the per-backend fp32_precision settings (reading the legacy flags then raises)
        "medium",  # torch.set_float32_matmul_precision("medium")
    ],
)
@pytest.mark.parametrize("dtype,device,off", [("fp32", "cuda", True), ("bf16", "cuda", False), ("fp32", "cpu", False)])
def test_fp32_turns_tf32_off_on_cuda_only_and_puts_the_settings_back(tf32_settings, how, dtype, device, off):
    # The settings are plain process-wide values: they can be read and set without CUDA.
    b = torch.backends
    if how == "legacy":
        b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = True
    elif how == "new":
        b.cuda.matmul.fp32_precision = b.cudnn.conv.fp32_precision = "tf32"
        b.cudnn.rnn.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("medium")
    before, precision = _tf32_state(), torch.get_float32_matmul_precision() if how != "new" else None
    with PrecisionPolicy(dtype).float32_arithmetic(torch.device(device)):
        assert _tf32_state() == (("ieee",) * 3 if off else before)
    assert _tf32_state() == before
    if precision is not None:
        assert torch.get_float32_matmul_precision() == precision


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["partitioned", "dense"])
def test_fp32_rows_of_a_cnn_are_float32_with_torchs_tf32_flags_on(tf32_settings, engine, device):
    model = zoo.small_cnn(NUM_CLASSES, width=4, seed=0).eval()
    data = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 8, 8), seed=1)
    truth = build_engine(
        model.double(), (data[0].double(), data[1]), num_classes=NUM_CLASSES, engine="reference"
    ).compute(range(NUM_CLASSES))
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True  # cuDNN's default; matmuls too
    rows = build_engine(model.float(), data, num_classes=NUM_CLASSES, engine=engine, device=device).compute(
        range(NUM_CLASSES)
    )
    # float32 against float64 on a small CNN: the engine tests' fp32 tolerance (TF32 would be ~1e-3).
    assert max_relative_error(rows.rows.cpu(), truth.rows) <= 2e-6
