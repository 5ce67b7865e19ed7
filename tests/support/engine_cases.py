"""The shared engine harness: small models x loss kinds, and a float64 reference to compare to.

Every engine test builds its cases here, so adding a model or a loss kind adds it to every
engine check at once.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers import zoo
from classgrad.workers.gradients import build_engine
from classgrad.workers.losses import partitioned_loss

NUM_CLASSES = 6
EMPTY_CLASS = 4
BATCH_SIZE = 5  # smaller than the probe set and than the largest class: several micro-batches


def log_softmax_mean(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A dense user loss: every sample touches every class through the softmax."""
    return -F.log_softmax(outputs, dim=1).mean(dim=0)


@partitioned_loss
def multi_margin(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A partitioned user loss (per-sample multi-class hinge)."""
    return F.multi_margin_loss(outputs, labels, reduction="none")


class StridedInplaceCNN(nn.Module):
    """Strided and dilated convolutions followed by in-place ReLUs: the layer outputs the
    partitioned engine's hooks capture are overwritten in place."""

    def __init__(self, num_classes: int):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, stride=2, dilation=2, padding=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 6, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(6, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TiedMLP(nn.Module):
    """One weight shared by two layers (tied)."""

    def __init__(self, num_classes: int):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 8)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.dec(torch.relu(self.enc(x)))))


class WeightUsedOutside(nn.Module):
    """A Linear's weight also used outside its module: hooks on the module miss that use.

    With ``gate_above``, the outside use only counts for samples whose first feature is above
    it, so only the classes of such samples get a gradient through it."""

    def __init__(self, num_classes: int, gate_above: float | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, num_classes)
        self.gate_above = gate_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        outside = 0.5 * h @ self.enc.weight
        if self.gate_above is not None:
            outside = outside * (x[:, :1] > self.gate_above).to(x.dtype)
        return self.head(h + outside)


def bn_without_running_stats() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, NUM_CLASSES),
    ).eval()


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], torch.nn.Module]
    data_kwargs: dict


MODEL_CASES = {
    "mlp": ModelCase(
        "mlp", lambda: zoo.mlp(NUM_CLASSES, in_features=8, hidden=16).eval(), dict(kind="vector", input_shape=(8,))
    ),
    "cnn": ModelCase(
        "cnn", lambda: zoo.small_cnn(NUM_CLASSES, width=4).eval(), dict(kind="image", input_shape=(3, 8, 8))
    ),
    "bn_eval": ModelCase(
        "bn_eval", lambda: zoo.bn_cnn(NUM_CLASSES, width=4).eval(), dict(kind="image", input_shape=(3, 8, 8))
    ),
    "bn_train": ModelCase(
        "bn_train", lambda: zoo.bn_cnn(NUM_CLASSES, width=4).train(), dict(kind="image", input_shape=(3, 8, 8))
    ),
    "strided_inplace": ModelCase(
        "strided_inplace", lambda: StridedInplaceCNN(NUM_CLASSES).eval(), dict(kind="image", input_shape=(3, 9, 9))
    ),
    "tied": ModelCase("tied", lambda: TiedMLP(NUM_CLASSES).eval(), dict(kind="vector", input_shape=(8,))),
    "weight_outside": ModelCase(
        "weight_outside", lambda: WeightUsedOutside(NUM_CLASSES).eval(), dict(kind="vector", input_shape=(8,))
    ),
    "bn_no_stats": ModelCase("bn_no_stats", bn_without_running_stats, dict(kind="image", input_shape=(3, 8, 8))),
    "transformer": ModelCase(
        "transformer",
        lambda: zoo.tiny_transformer(NUM_CLASSES, vocab=32, dim=8, max_len=8).eval(),
        dict(kind="tokens", vocab=32, seq_len=6),
    ),
    # Fewer features into the final Linear layer than classes: the dense engine's rows through
    # the head (classgrad.workers.engines.head) apply to linear losses.
    "narrow_mlp": ModelCase(
        "narrow_mlp",
        lambda: zoo.mlp(NUM_CLASSES, in_features=8, hidden=5).eval(),
        dict(kind="vector", input_shape=(8,)),
    ),
    "narrow_bn_train": ModelCase(
        "narrow_bn_train", lambda: zoo.bn_cnn(NUM_CLASSES, width=1).train(), dict(kind="image", input_shape=(3, 8, 8))
    ),
}
# Models whose final Linear layer has fewer input features than there are classes.
NARROW_HEAD_MODELS = {"narrow_mlp", "narrow_bn_train"}

LOSS_CASES = {
    "cross_entropy": "cross_entropy",
    "logit": "logit",
    "bce": "bce",
    "custom_dense": log_softmax_mean,
    "custom_partitioned": multi_margin,
}
PARTITIONED_LOSSES = {"cross_entropy", "custom_partitioned"}

# Unit roundoff u: fp16 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3. Activations, weight copies and
# activation gradients are rounded about once per layer; over the 3-6 layers of these models the
# rows land within a few u of the truth, more where a class's per-sample gradients cancel (the
# error scales with the sum of the parts, not with their small sum). Observed worst cases:
# fp16 4.3e-3 (9u), bf16 4.4e-2 (11u, a class whose samples' gradients largely cancel; all three
# engines give that same row bit for bit), BatchNorm in train mode (batch statistics in low
# precision) fp16 3.6e-3 and bf16 4.1e-2. The bounds, about 20-25u, leave room for those and
# still sit far below what a missing unscale (error ~1e4) or a wrong row (error ~1) would give.
LOW_PRECISION_TOLERANCE = {"fp16": 1e-2, "bf16": 1e-1}
# Models whose samples interact in the forward (batch statistics): only dense engines apply.
BATCH_COUPLED_MODELS = {"bn_train", "bn_no_stats", "narrow_bn_train"}


def applicable(model_case: str, loss_case: str, engine: str) -> bool:
    """Whether ``engine`` takes the case: the partitioned engine takes class-partitioned losses
    of models whose samples do not interact."""
    if engine != "partitioned":
        return True
    return loss_case in PARTITIONED_LOSSES and model_case not in BATCH_COUPLED_MODELS


def probe_data(model_case: str, loss_case: str, samples_per_class: int = 3):
    """Imbalanced classes (one empty, one bigger than a batch), multi-hot targets for bce."""
    return zoo.synthetic_probe(
        NUM_CLASSES,
        samples_per_class,
        imbalance=1.0,
        empty_classes=[EMPTY_CLASS],
        multilabel=loss_case == "bce",
        seed=1,
        **MODEL_CASES[model_case].data_kwargs,
    )


def engine_for(
    model_case: str, loss_case: str, engine: str, *, float64: bool = False, samples_per_class: int = 3, **options
):
    model = MODEL_CASES[model_case].build()
    if float64:
        model = copy.deepcopy(model).double()
    return build_engine(
        model,
        probe_data(model_case, loss_case, samples_per_class),
        num_classes=NUM_CLASSES,
        loss=LOSS_CASES[loss_case],
        engine=engine,
        batch_size=BATCH_SIZE,
        **options,
    )


@functools.cache
def reference_rows(model_case: str, loss_case: str, samples_per_class: int = 3):
    """The reference engine in float64: the ground truth every engine is compared with."""
    block = engine_for(model_case, loss_case, "reference", float64=True, samples_per_class=samples_per_class).compute(
        range(NUM_CLASSES)
    )
    return block.rows, block.loss


def max_relative_error(rows: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest normwise relative error over the rows that are not zero in the reference."""
    ref = ref.double()
    nonzero = ref.norm(dim=1) > 0
    err = (rows.double() - ref).norm(dim=1)[nonzero] / ref.norm(dim=1)[nonzero]
    return float(err.max())


def zero_rows(rows: torch.Tensor) -> torch.Tensor:
    return (rows == 0).all(dim=1)


def fell_back(eng) -> bool:
    """Whether a partitioned engine gave up a path (hooks or vmap) on the way: its path line
    (``stats.notes``) then says which, with ``abandoned``."""
    return any("abandoned" in note for note in eng.stats.notes)
