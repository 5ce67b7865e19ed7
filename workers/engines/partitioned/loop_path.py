"""The last resort of the partitioned engine: one forward per pack of classes, a backward per class.

Holds ``LoopPath``. When neither the hooks nor vmap can do a model, a pack's samples (at most a
batch, ``packing.plan_packs``) still go through ONE forward; each class's row is then one
``torch.autograd.grad(..., retain_graph=True)`` of its own samples' loss on that graph. That is
never slower than the per-class loop (one forward over the probe set, then a backward per class
through all of it): the same number of backward calls, each through a graph of one pack instead
of the whole probe set, and fewer samples in the forward. Works for any model autograd can run.
"""

from __future__ import annotations

import torch

from classgrad.workers.engines.base import GradientEngine
from classgrad.workers.engines.partitioned.packing import ClassSamples
from classgrad.workers.engines.partitioned.vmap_path import WriteRows
from classgrad.workers.losses import PartitionedLoss


class LoopPath:
    """Rows of packs of classes from one forward and one backward per class, for one engine."""

    def __init__(self, engine: GradientEngine, samples: ClassSamples, write: WriteRows):
        self.engine = engine
        self.samples = samples
        self.write = write

    def rows(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` (at most a batch of samples) at loss scales ``scales`` into
        ``dest[where]``: (losses, finite)."""
        eng = self.engine
        loss = eng.loss
        assert isinstance(loss, PartitionedLoss)  # the partitioned engine takes no other loss
        cls = torch.tensor(classes)
        counts = eng.counts[cls]
        k = len(classes)
        if int(counts.sum()) == 0:
            dest[where] = 0
            return torch.zeros(k, dtype=eng.row_dtype, device=eng.device), torch.ones(k, dtype=torch.bool)
        indices, local, _ = self.samples.consecutive(cls)
        x, y = eng.probe.batch(indices, eng.device, eng.compute_dtype)
        with eng.forward_context(0):
            out = eng.io(x)  # dict batches as keyword arguments, the logits out
        eng.stats.forwards += 1
        loss.check_outputs(out)
        weighted, values = loss.run_losses(out, y, local.to(eng.device), counts)
        eng.check_finite_loss(values, cls)
        acc: list[torch.Tensor | None] = [None] * len(eng.params)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        live = [i for i in range(k) if int(counts[i]) > 0]
        for n, i in enumerate(live):
            # The class's samples are consecutive in the pack: its loss is one slice's sum.
            part = weighted[starts[i] : starts[i] + int(counts[i])].sum() * float(scales[i])
            if not part.requires_grad:
                continue
            last = n == len(live) - 1
            grads = torch.autograd.grad(part, eng.params, retain_graph=not last, allow_unused=True)
            eng.stats.backwards += 1
            for j, g in enumerate(grads):
                if g is None:
                    continue
                if acc[j] is None:
                    acc[j] = g.new_zeros(k, *g.shape)
                acc[j][i] = g  # type: ignore[index]
        if all(a is None for a in acc):  # no path to the loss: zero rows
            dest[where] = 0
            return values.detach(), torch.ones(k, dtype=torch.bool)
        return values.detach(), self.write(acc, scales, dest, where)
