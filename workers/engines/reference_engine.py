"""The reference engine: the slow, obvious per-class loop every fast engine is tested against.

For each class c it runs the whole probe set forward (micro-batch by micro-batch, exactly as the
other engines do), adds up L, and takes ``torch.autograd.grad(L[c], params)`` on a fresh graph.
C full forward+backward passes: use it to check results, not to compute many rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from classgrad.workers.amp import rows_with_rescale
from classgrad.workers.engines.base import GradientEngine, RowBlock


class ReferenceEngine(GradientEngine):
    """One fresh forward over the probe set and one backward per class."""

    name = "reference"

    def _row(self, c: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = None
        for mb in self.probe.micro_batches():
            _, contrib = self.forward(mb)
            total = contrib if total is None else total + contrib
        assert total is not None
        # Any non-finite L_k poisons every row through the shared graph (0 * NaN = NaN).
        self.check_finite_loss(total.detach(), torch.arange(len(total)))
        grads = torch.autograd.grad(total[c] * scale, self.params, allow_unused=True)
        self.stats.backwards += 1
        row = self.grads_to_rows(grads, batch_dims=0) / scale
        return row, total[c].detach()

    def iter_blocks(self, classes: Sequence[int]) -> Iterator[RowBlock]:
        yield from self.computed(self._row_blocks(self._check_classes(classes)))

    def _row_blocks(self, ids: torch.Tensor) -> Iterator[RowBlock]:
        for c in ids.tolist():
            losses: list[torch.Tensor] = []

            def compute(which: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
                row, value = self._row(c, float(scales[0]))  # noqa: B023 - called within this iteration
                losses.append(value)  # noqa: B023 - called within this iteration
                return row.unsqueeze(0)

            rows, scales, again = rows_with_rescale(compute, 1, self.precision, ids.new_tensor([c]), self.device)
            value = losses[-1].reshape(1)
            self.stats.rows += 1
            self.stats.recomputed_rows += int(again.sum())
            yield RowBlock(
                classes=ids.new_tensor([c]),
                rows=rows,
                loss=value.cpu(),
                count=self.counts[[c]],
                loss_scale=scales.cpu(),
                recomputed=again.cpu(),
            )
