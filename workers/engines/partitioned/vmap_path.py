"""The vmap path: several classes in one pass of ``torch.func.vmap(grad(...))`` over the class axis.

Holds ``VmapPath``. A pack's samples are laid out as ``[K classes, m samples]``, short classes
padded with weight-0 copies of their own samples (which add exactly zero); packing
(``packing.plan_packs``) groups classes of similar size to limit padding. Works for any model
``torch.func`` can run; the engine falls back to one class at a time when it cannot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from classgrad.workers.engines.base import GradientEngine, NormInFloat32, parameters_kept
from classgrad.workers.engines.partitioned.packing import ClassSamples
from classgrad.workers.losses import PartitionedLoss
from classgrad.workers.probe import tree_map_tensors

# Writes per-parameter gradients [k, *shape] at loss scales into dest[where]: whether each row is finite.
WriteRows = Callable[[Sequence[torch.Tensor | None], torch.Tensor, torch.Tensor, "slice | torch.Tensor"], torch.Tensor]


class VmapPath:
    """Rows of packs of classes from one vmapped gradient, for one engine."""

    def __init__(self, engine: GradientEngine, samples: ClassSamples, write: WriteRows):
        self.engine = engine
        self.samples = samples
        self.write = write
        self._vmapped: Callable | None = None

    def _build(self) -> Callable:
        from torch.func import grad, vmap

        eng = self.engine
        io, loss, precision, device = eng.io, eng.loss, eng.precision, eng.device
        assert isinstance(loss, PartitionedLoss)  # the partitioned engine takes no other loss
        low_precision = precision.dtype != "fp32"

        def class_loss(
            params: dict, x: object, y: torch.Tensor, w: torch.Tensor, s: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            with precision.autocast(device), NormInFloat32() if low_precision else contextlib.nullcontext():
                out = io.functional(params, x)
            loss.check_outputs(out)
            value = (loss.sample_losses(out, loss.labels(y)) * w).sum()
            return value * s, value

        return vmap(grad(class_loss, has_aux=True), in_dims=(None, 0, 0, 0, 0))

    def rows(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` at loss scales ``scales`` into ``dest[where]``: (losses, finite)."""
        eng = self.engine
        if self._vmapped is None:
            self._vmapped = self._build()
        cls = torch.tensor(classes)
        counts = eng.counts[cls]
        k, width = len(classes), int(counts.max())
        if width == 0:  # only empty classes
            dest[where] = 0
            return torch.zeros(k, dtype=eng.row_dtype, device=eng.device), torch.ones(k, dtype=torch.bool)
        # [k, width] grid of sample indices; short classes repeat their own last sample with weight 0.
        padded = self.samples.padded(cls, width)
        j = torch.arange(width)
        weights = torch.where(j.unsqueeze(0) < counts.unsqueeze(1), 1.0 / counts.unsqueeze(1).double(), 0.0)
        weights = weights.to(eng.device, eng.compute_dtype)
        x, y = eng.probe.batch(padded.reshape(-1), eng.device, eng.compute_dtype)
        x = eng.io.select(x)  # only what the model takes (raw text cannot be vmapped)
        x, y = tree_map_tensors(lambda t: t.reshape(k, width, *t.shape[1:]), (x, y))
        params = {s.name: p.detach() for s, p in zip(eng.layout.slots, eng.params)}
        with parameters_kept(eng.model):
            grads, values = self._vmapped(params, x, y, weights, scales.to(eng.device, eng.compute_dtype))
        eng.stats.forwards += 1
        eng.stats.backwards += 1
        eng.check_finite_loss(values.detach(), cls)
        finite = self.write([grads[s.name] for s in eng.layout.slots], scales, dest, where)
        return values.detach(), finite
