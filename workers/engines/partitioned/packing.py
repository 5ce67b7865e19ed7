"""How the partitioned engine groups classes for one pass: packs (vmap) and runs (hooks).

Holds ``plan_packs`` (classes of similar size, padded to a common width, for the vmap path) and
``plan_runs`` (consecutive classes, unpadded, for the hook path); classes bigger than half a
batch go alone in both. ``ClassSamples`` finds the samples of a run, a pack or one class
(one sorted index for all C classes: nothing is held per class).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_packs(sizes: torch.Tensor, batch_size: int, max_rows: int) -> tuple[list[list[int]], list[int]]:
    """Split positions ``0..len(sizes)`` into packs and single classes.

    A pack holds classes of similar size whose padded footprint ``K * max(size)`` fits in
    ``batch_size``; classes bigger than half a batch go alone (packing would not help).
    Empty classes go nowhere. Returns ``(packs, singles)``.
    """
    packs: list[list[int]] = []
    singles: list[int] = []
    current: list[int] = []
    for pos in torch.argsort(sizes, stable=True).tolist():
        n = int(sizes[pos])
        if n == 0:
            continue
        if 2 * n > batch_size:
            singles.append(pos)
            continue
        # Sizes ascend, so the new class sets the padded width of the pack.
        if current and ((len(current) + 1) * n > batch_size or len(current) >= max_rows):
            packs.append(current)
            current = []
        current.append(pos)
    if current:
        packs.append(current)
    return packs, singles


def plan_runs(
    sizes: torch.Tensor, batch_size: int, max_rows: int, padded_batches: int = 2
) -> tuple[list[tuple[int, int]], list[int]]:
    """Split positions ``0..len(sizes)`` into runs of consecutive positions and single classes.

    A run holds at most ``batch_size`` samples and ``max_rows`` classes, and its padded
    footprint ``K * max(size)`` (which only the per-class reduction pays) stays within
    ``padded_batches`` batches. Classes bigger than half a batch go alone. Empty classes ride along in runs (their
    rows come out zero). Returns ``(runs as (start, stop), singles)``.
    """
    runs: list[tuple[int, int]] = []
    singles: list[int] = []
    start, total, width = None, 0, 0
    for pos, n in enumerate(sizes.tolist()):
        if 2 * n > batch_size:
            if start is not None:
                runs.append((start, pos))
                start = None
            singles.append(pos)
            continue
        if start is not None:
            k = pos - start + 1
            if total + n > batch_size or k > max_rows or k * max(width, n) > padded_batches * batch_size:
                runs.append((start, pos))
                start = None
        if start is None:
            start, total, width = pos, 0, 0
        total += n
        width = max(width, n)
    if start is not None:
        runs.append((start, len(sizes)))
    return runs, singles


@dataclass(frozen=True)
class ClassSamples:
    """Where each class's samples are, as one flat index: class c's samples are
    ``order[start[c] : start[c] + counts[c]]``, so a run's or a pack's samples are gathered with
    one indexing op instead of a loop over classes."""

    order: torch.Tensor
    start: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def from_labels(cls, labels: torch.Tensor, counts: torch.Tensor) -> ClassSamples:
        return cls(torch.argsort(labels, stable=True), torch.cumsum(counts, 0) - counts, counts)

    def of(self, c: int) -> torch.Tensor:
        """Class ``c``'s sample indices, in probe order (a view: nothing is split per class, as a
        list of C views would be: 36 ms a training step at C = 10,000)."""
        start = int(self.start[c])
        return self.order[start : start + int(self.counts[c])]

    def consecutive(self, classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The samples of ``classes``, class after class, no padding: ``(indices, local, within)``
        with each sample's position in ``classes`` and its position within its class."""
        counts = self.counts[classes]
        local = torch.repeat_interleave(torch.arange(len(classes)), counts)
        first = torch.cumsum(counts, 0) - counts
        within = torch.arange(int(counts.sum())) - first[local]
        return self.order[self.start[classes][local] + within], local, within

    def padded(self, classes: torch.Tensor, width: int) -> torch.Tensor:
        """``[k, width]`` sample indices; a short class repeats its own last sample."""
        counts = self.counts[classes]
        j = torch.arange(width)
        take = self.start[classes].unsqueeze(1) + torch.minimum(j.unsqueeze(0), (counts - 1).unsqueeze(1))
        return self.order[take]
