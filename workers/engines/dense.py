"""The dense engine: rows as vector-Jacobian products with one-hot cotangents.

For losses where every sample touches every L_c (``logit``, ``bce``, a user's callable, or any
loss through BatchNorm in train mode). Per micro-batch the model runs forward once; then blocks
of rows are VJPs of that micro-batch's contribution to L with one-hot cotangents
(``torch.autograd.grad(..., is_grads_batched=True)``), all on the one graph, which is released
after the last block. Rows over several micro-batches are summed.

Memory: with one micro-batch, blocks stream out as they are computed (one block of rows alive).
With several, a group of at most ``group_rows`` rows (fewer if ``D`` is large) is accumulated
while every micro-batch passes once; so memory is bounded by the group, never by C.

The block size, when not given, is chosen by timing a few sizes on the first micro-batch.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

import torch

from workers.amp import rows_with_rescale
from workers.engines.base import GradientEngine, RowBlock

log = logging.getLogger(__name__)

BLOCK_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
# Bytes of gradient rows (one block, or one accumulated group) an engine may hold at once.
ROW_BYTES_BUDGET = 1 << 30


class DenseEngine(GradientEngine):
    """One forward per micro-batch, then batched VJPs for blocks of rows on that graph."""

    name = "dense"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._batched_vjp = True  # falls back to a loop of single VJPs if vmap cannot batch the model
        # Every L_k is checked, not only the rows asked for: one non-finite L_k poisons every
        # VJP on the shared graph (0 * NaN = NaN), and the error should name its class.
        self._all_classes = torch.arange(self.loss.num_classes)

    # --- one block of VJPs --------------------------------------------------------------------

    def _vjp_rows(self, contrib: torch.Tensor, classes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Rows ``d contrib[classes[k]] / d params``, computed at loss scale ``scales[k]`` and unscaled."""
        cot = torch.zeros(len(classes), contrib.shape[0], dtype=contrib.dtype, device=contrib.device)
        cot[torch.arange(len(classes), device=contrib.device), classes] = scales.to(contrib.dtype)
        grads = None
        if self._batched_vjp and len(classes) > 1:
            try:
                grads = torch.autograd.grad(
                    contrib, self.params, grad_outputs=cot, is_grads_batched=True,
                    retain_graph=True, allow_unused=True,
                )
                self.stats.backwards += 1
            except RuntimeError as exc:
                self._batched_vjp = False
                msg = f"batched VJP unavailable for this model ({exc}); computing rows one at a time"
                log.warning(msg)
                self.stats.notes.append(msg)
        if grads is None:
            per_row = []
            for k in range(len(classes)):
                per_row.append(torch.autograd.grad(
                    contrib, self.params, grad_outputs=cot[k], retain_graph=True, allow_unused=True
                ))
                self.stats.backwards += 1
            grads = [
                None if all(g[i] is None for g in per_row)
                else torch.stack([g[i] if g[i] is not None else torch.zeros_like(p) for g in per_row])
                for i, p in enumerate(self.params)
            ]
        rows = self.grads_to_rows(grads, batch_dims=1)
        return rows / scales.to(rows.dtype).unsqueeze(1)

    def _rows_for(self, contrib: torch.Tensor, classes: torch.Tensor):
        """Rows for ``classes`` (device tensor) from one graph, overflowed rows recomputed."""
        return rows_with_rescale(
            lambda which, scales: self._vjp_rows(contrib, classes[which], scales),
            len(classes), self.precision, classes.cpu(), self.device,
        )

    # --- block size ----------------------------------------------------------------------------

    def _row_limit(self) -> int:
        return max(1, ROW_BYTES_BUDGET // (4 * self.layout.dim))

    def _choose_block_rows(self, contrib: torch.Tensor, classes: torch.Tensor) -> int:
        """Time a few block sizes on this graph and keep the fastest per row."""
        limit = min(len(classes), self._row_limit())
        candidates = [b for b in BLOCK_CANDIDATES if b <= limit] or [1]
        self._rows_for(contrib, classes[:1])  # warm-up: first call pays one-off costs
        timings: dict[int, float] = {}
        for b in candidates:
            t0 = time.perf_counter()
            self._rows_for(contrib, classes[:b])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            timings[b] = (time.perf_counter() - t0) / b
            if timings[b] > 1.5 * min(timings.values()):
                break  # past the sweet spot; larger blocks only cost memory
        best = min(timings, key=timings.get)
        note = "dense block_rows=%d chosen from per-row times %s" % (
            best, {b: f"{t * 1e3:.2f}ms" for b, t in timings.items()})
        log.info(note)
        self.stats.notes.append(note)
        return best

    # --- public --------------------------------------------------------------------------------

    def iter_blocks(self, classes: Sequence[int]) -> Iterator[RowBlock]:
        ids = self._check_classes(classes)
        if len(ids) == 0:
            return
        with self.selected_grads():
            if self.probe.num_micro_batches == 1:
                yield from self._stream(ids)
            else:
                group = min(self.group_rows, self._row_limit())
                for g0 in range(0, len(ids), group):
                    yield from self._accumulate(ids[g0 : g0 + group])

    def _stream(self, ids: torch.Tensor) -> Iterator[RowBlock]:
        """One micro-batch: one forward, then every block on its graph, each yielded at once."""
        mb = next(self.probe.micro_batches())
        _, contrib = self.forward(mb)
        dev_ids = ids.to(self.device)
        self.check_finite_loss(contrib.detach(), self._all_classes)
        if self.block_rows is None:
            self.block_rows = self._choose_block_rows(contrib, dev_ids)
        for b0 in range(0, len(ids), self.block_rows):
            which = dev_ids[b0 : b0 + self.block_rows]
            rows, scales, again = self._rows_for(contrib, which)
            yield self._block(ids[b0 : b0 + self.block_rows], rows, contrib.detach()[which], scales, again)
        del contrib  # the graph goes with its last reference

    def _accumulate(self, ids: torch.Tensor) -> Iterator[RowBlock]:
        """Several micro-batches: every micro-batch passes once, its rows added into the group."""
        dev_ids = ids.to(self.device)
        acc = torch.zeros(len(ids), self.layout.dim, dtype=torch.promote_types(self.compute_dtype, torch.float32),
                          device=self.device)
        values = torch.zeros(len(ids), dtype=acc.dtype, device=self.device)
        min_scale = torch.full((len(ids),), float("inf"), device=self.device)
        again = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        for mb in self.probe.micro_batches():
            _, contrib = self.forward(mb)
            self.check_finite_loss(contrib.detach(), self._all_classes)
            values += contrib.detach()[dev_ids]
            if self.block_rows is None:
                self.block_rows = self._choose_block_rows(contrib, dev_ids)
            for b0 in range(0, len(ids), self.block_rows):
                sl = slice(b0, b0 + self.block_rows)
                rows, scales, redo = self._rows_for(contrib, dev_ids[sl])
                acc[sl] += rows
                min_scale[sl] = torch.minimum(min_scale[sl], scales)
                again[sl] |= redo
            del contrib
        yield self._block(ids, acc, values, min_scale, again)

    def _block(self, ids, rows, values, scales, again) -> RowBlock:
        self.stats.rows += len(ids)
        self.stats.recomputed_rows += int(again.sum())
        return RowBlock(
            classes=ids, rows=rows, loss=values.detach().float().cpu(), count=self.counts[ids],
            loss_scale=scales.float().cpu(), recomputed=again.cpu(),
        )
