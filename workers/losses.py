"""Per-class loss kinds: how model outputs become the vector L = (L_0 ... L_{C-1}).

Holds the ``LossKind`` interface, its two families and the registry:

- ``PartitionedLoss``: every sample has one integer label and L_c is the mean of a per-sample
  loss over the samples labelled c (``cross_entropy``, or a user's per-sample loss marked with
  ``@partitioned_loss``). A class with no samples has L_c = 0, a zero row and count 0.
- ``DenseLoss``: every sample may touch every L_c. The loss function maps ``(outputs, targets)``
  of a set of samples to their per-class mean ``[C]`` (``logit``, ``bce``, or a user's
  callable); over the whole probe set, micro-batch b contributes ``fn(batch) * n_b / N``, so L
  is the probe-set mean whenever ``fn`` is a mean.

Every engine asks the loss for the same thing, ``batch_losses``: micro-batch contributions that
add up to L. The partitioned engine additionally uses ``labels`` and ``sample_losses``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from classgrad.config.choices import LOSS_KINDS
from classgrad.errors import InputError
from classgrad.registry import Registry
from classgrad.workers.imports import import_object


def check_label_range(
    labels: torch.Tensor, num_classes: int, *, prefix: str = "labels outside", item: str = "sample"
) -> None:
    """Integer labels all in ``[0, num_classes)``, or one line naming the first that is not (the
    engines', the training step's and the query rows' check)."""
    bad = (labels < 0) | (labels >= num_classes)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise InputError(
            f"{prefix} [0, {num_classes}): {item} {i} has label {int(labels[i])} ({int(bad.sum())} such {item}s)"
        )


class LossKind(ABC):
    """How per-class losses are computed from model outputs and targets."""

    name: str = ""
    partitioned: bool = False
    # L_c depends on the outputs only through column c (``logit``, ``bce``): the dense engine may
    # then start each row's backward at the input of the model's final Linear layer.
    per_column: bool = False
    # Moreover L_c = sum_n w_n * outputs[n, c] with sample weights w that do not depend on c
    # (``logit``): rows then come from a basis of one VJP per feature into that layer.
    linear_in_outputs: bool = False

    def __init__(self, num_classes: int):
        if num_classes <= 0:
            raise InputError(f"loss.num_classes must be > 0, got {num_classes}")
        self.num_classes = int(num_classes)

    @abstractmethod
    def validate_targets(self, targets: torch.Tensor) -> None:
        """Raise ``InputError`` if the probe set's targets do not fit this loss."""

    @abstractmethod
    def counts(self, targets: torch.Tensor) -> torch.Tensor:
        """int64 ``[C]``: probe samples that contribute to each L_c."""

    @abstractmethod
    def batch_losses(self, outputs: torch.Tensor, targets: torch.Tensor, norm: LossNorm) -> torch.Tensor:
        """float ``[C]``: this micro-batch's contribution to L (contributions add up to L)."""

    def check_outputs(self, outputs: torch.Tensor) -> None:
        if outputs.ndim != 2 or outputs.shape[1] != self.num_classes:
            raise InputError(
                f"model output has shape {tuple(outputs.shape)}, expected (batch, {self.num_classes}) "
                f"for loss.num_classes={self.num_classes}"
            )

    def norm(self, targets: torch.Tensor) -> LossNorm:
        """Probe-wide normalisers, computed once from all targets."""
        return LossNorm(total=len(targets), counts=self.counts(targets))


class LossNorm:
    """Probe-wide normalisers: sample total and per-class counts (on any device)."""

    def __init__(self, total: int, counts: torch.Tensor):
        self.total = int(total)
        self.counts = counts

    def to(self, device: torch.device) -> LossNorm:
        return LossNorm(self.total, self.counts.to(device))


class PartitionedLoss(LossKind):
    """L_c = mean of ``sample_loss(outputs_i, y_i)`` over the samples with label ``y_i == c``."""

    partitioned = True

    def __init__(self, num_classes: int, sample_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str):
        super().__init__(num_classes)
        self._sample_loss = sample_loss
        self.name = name

    def labels(self, targets: torch.Tensor) -> torch.Tensor:
        return targets.long()

    def validate_targets(self, targets: torch.Tensor) -> None:
        if targets.ndim != 1 or targets.is_floating_point():
            raise InputError(
                f"loss {self.name!r}: targets must be integer class labels of shape [N], "
                f"got {tuple(targets.shape)} {targets.dtype}"
            )
        # Named as both spellings: the function's num_classes, a job file's loss.num_classes.
        check_label_range(targets, self.num_classes, prefix="labels outside num_classes (loss.num_classes)")

    def counts(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.bincount(self.labels(targets), minlength=self.num_classes)

    def sample_losses(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = self._sample_loss(outputs, labels)
        if losses.shape != labels.shape:
            raise InputError(
                f"loss {self.name!r}: per-sample loss returned shape {tuple(losses.shape)}, "
                f"expected {tuple(labels.shape)}"
            )
        return losses

    def run_losses(
        self, outputs: torch.Tensor, targets: torch.Tensor, local: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A run of ``k`` classes in one pass: each sample's loss weighted by 1 / its class's size (a
        class's weighted losses sum to its mean loss), and the ``[k]`` per-class losses (detached).
        ``local``: each sample's position among the run's classes, on the outputs' device;
        ``counts``: the run's samples per class."""
        per_sample = self.sample_losses(outputs, self.labels(targets))
        weights = (1.0 / counts.clamp(min=1).double()).to(per_sample.device, per_sample.dtype)[local]
        weighted = per_sample * weights
        values = torch.zeros(len(counts), dtype=weighted.dtype, device=weighted.device)
        return weighted, values.index_add_(0, local, weighted.detach())

    def batch_losses(self, outputs: torch.Tensor, targets: torch.Tensor, norm: LossNorm) -> torch.Tensor:
        labels = self.labels(targets)
        per_sample = _upcast(self.sample_losses(outputs, labels))
        weights = 1.0 / norm.counts[labels].clamp(min=1).to(per_sample.dtype)
        out = torch.zeros(self.num_classes, dtype=per_sample.dtype, device=per_sample.device)
        return out.index_add(0, labels, per_sample * weights)


class DenseLoss(LossKind):
    """L = sum over micro-batches of ``fn(outputs, targets) * n_b / N``; ``fn`` returns ``[C]``."""

    partitioned = False

    def __init__(
        self,
        num_classes: int,
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        name: str,
        multi_hot_targets: bool = False,
        per_column: bool = False,
        linear_in_outputs: bool = False,
    ):
        super().__init__(num_classes)
        self._fn = fn
        self.name = name
        self.multi_hot_targets = multi_hot_targets
        self.per_column = per_column or linear_in_outputs
        self.linear_in_outputs = linear_in_outputs

    def validate_targets(self, targets: torch.Tensor) -> None:
        if self.multi_hot_targets and (targets.ndim != 2 or targets.shape[1] != self.num_classes):
            raise InputError(
                f"loss {self.name!r}: targets must be multi-hot of shape [N, {self.num_classes}], "
                f"got {tuple(targets.shape)}"
            )

    def counts(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.full((self.num_classes,), len(targets), dtype=torch.int64)

    def batch_losses(self, outputs: torch.Tensor, targets: torch.Tensor, norm: LossNorm) -> torch.Tensor:
        per_class = self._fn(outputs, targets)
        if per_class.shape != (self.num_classes,):
            raise InputError(
                f"loss {self.name!r} returned shape {tuple(per_class.shape)}, expected ({self.num_classes},)"
            )
        return _upcast(per_class) * (outputs.shape[0] / norm.total)


# --- built-in loss functions -------------------------------------------------------------


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs (under autocast) to float32; float32/float64 stay as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # log-softmax in at least float32: under autocast the logits may be half precision.
    return F.cross_entropy(_upcast(outputs), labels, reduction="none")


def _logit(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _upcast(outputs).mean(dim=0)


def _bce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Binary cross-entropy with logits, log(1 + e^z) - t z, from logaddexp (as stable as
    # F.binary_cross_entropy_with_logits, the same values up to rounding): the fused op's backward
    # batches poorly under torch.func.vmap; with it the dense engine's batched VJPs ran at 0.49x
    # the speed of `is_grads_batched` (`benchmarks/alternatives.py --quick --sections dense`).
    z = _upcast(outputs)
    return (torch.logaddexp(z, z.new_zeros(())) - targets.to(z.dtype) * z).mean(dim=0)


def partitioned_loss(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Mark ``fn(outputs [n, C], labels [n]) -> [n]`` as a per-sample, class-partitioned loss."""
    fn.partitioned = True  # type: ignore[attr-defined]
    return fn


LossFactory = Callable[[int], LossKind]
LOSSES: Registry[LossFactory] = Registry(
    "loss kind",
    unknown="loss.kind {name!r} is unknown (choices: {choices}, or 'module:function')",
    error=InputError,
    choices=LOSS_KINDS,
)


def register_loss(name: str) -> Callable[[LossFactory], LossFactory]:
    def wrap(factory: LossFactory) -> LossFactory:
        if name in LOSSES:
            raise ValueError(f"loss kind {name!r} is already registered")
        # A job file may name it; "dense" when every sample contributes to every class (asked of
        # the kind it builds for 2 classes, before anything is registered).
        dense = not factory(2).partitioned
        return LOSSES.register(name, factory, traits=("dense",) if dense else ())

    return wrap


register_loss("cross_entropy")(lambda c: PartitionedLoss(c, _cross_entropy, "cross_entropy"))
register_loss("logit")(lambda c: DenseLoss(c, _logit, "logit", linear_in_outputs=True))
register_loss("bce")(lambda c: DenseLoss(c, _bce, "bce", multi_hot_targets=True, per_column=True))


def create_loss(kind: str | Callable | LossKind, num_classes: int) -> LossKind:
    """A registered name, a ``module:function`` path, or a callable (a ``LossKind`` is returned as is).

    A callable marked with ``@partitioned_loss`` is a per-sample loss; any other callable maps
    ``(outputs, targets)`` to the per-class mean ``[C]`` over the samples it is given.
    """
    if isinstance(kind, LossKind):
        return kind
    if isinstance(kind, str) and ":" not in kind:
        return LOSSES.get(kind)(num_classes)
    fn = import_object(kind, what="loss.kind") if isinstance(kind, str) else kind
    if not callable(fn):
        raise InputError(f"loss.kind {kind!r} is not callable")
    name = kind if isinstance(kind, str) else getattr(fn, "__qualname__", "custom")
    if getattr(fn, "partitioned", False):
        return PartitionedLoss(num_classes, fn, name)
    return DenseLoss(num_classes, fn, name)
