"""Rows of a per-class loss vector the user computed, by VJPs with one-hot cotangents in blocks.

Holds:
- ``check_loss_vector``: the one-line refusals of a loss that is not a vector or has no graph.
- ``LossRows``: rows ``d loss[c] / d params`` for every entry of a loss vector, ``block`` rows per
  batched backward (``torch.autograd.grad(..., is_grads_batched=True)``), falling back to one
  ``torch.autograd.grad`` per row (``retain_graph=True``) for graphs whose operations have no
  batching rule; the graph is kept only while the blocks run and the last block frees it. The
  block size, unless given, is measured on the first calls' own blocks and kept.

Memory: one block of gradients (``block x D`` floats and the batched backward's activations
gradients) on top of the rows' own buffer: it does not grow with C. The cotangents go to
``loss.float() * scale``, as ``GradScaler.scale(loss)`` multiplies in float32, so an fp16
forward overflows (or not) at the same scale as plain ``GradScaler`` usage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from classgrad.errors import InputError
from classgrad.workers.engines.base import choice_clock
from classgrad.workers.layout import ParamLayout

log = logging.getLogger(__name__)

# Rows per batched backward unless the caller says: the sizes tried (on real rows, the first
# calls' blocks: nothing is computed twice) and the smallest within CHOICE_SLACK of the fastest
# per row kept; capped so that a block's gradients stay within BLOCK_BYTES (its activations'
# gradients scale with it too). On a CPU a batched backward is not always faster than a loop of
# single ones (measured here: 1.7x faster on a tiny BERT, 1.4x slower on a small CNN).
BLOCK_CANDIDATES = (1, 4, 16, 32)
WARMUP_ROWS = 4  # the first batched block pays vmap's set-up: not timed
CHOICE_SLACK = 1.05
BLOCK_BYTES = 256 << 20


def check_loss_vector(loss: object) -> torch.Tensor:
    """``loss`` as it is when it is a per-class loss vector with a graph; one line otherwise."""
    if not isinstance(loss, torch.Tensor):
        raise InputError(f"loss must be a tensor of per-class losses [C], got {type(loss).__name__}")
    if loss.ndim != 1 or loss.numel() == 0:
        raise InputError(
            f"loss must be a vector of per-class losses [C], got shape {list(loss.shape)} "
            "(a scalar loss has no per-class rows: use GradScaler itself, or return one loss per class)"
        )
    if not loss.is_floating_point():
        raise InputError(f"loss must be floating point, got {loss.dtype}")
    if loss.grad_fn is None:
        raise InputError(
            "loss has no graph (computed under torch.no_grad or inference_mode, detached, or from "
            "parameters that do not require grad): rows need the forward's graph"
        )
    return loss


class LossRows:
    """Rows of loss vectors, block by block; remembers whether batched backwards work here."""

    def __init__(self, block_rows: int | None = None):
        if block_rows is not None and (
            isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows <= 0
        ):
            raise InputError(f"block_rows must be an integer > 0, got {block_rows!r}")
        self.block_rows = block_rows
        self.batched: bool | None = None  # None until tried: then whether is_grads_batched worked
        self.per_row: dict[int, float] = {}  # block size -> seconds per row, measured
        self.warm = False
        self.chosen: int | None = block_rows  # the block size kept
        self._reached = False  # whether the current call's graph reached any parameter

    def _next(self, remaining: int, dim: int) -> tuple[int, bool]:
        """(rows of the next block, whether its time is a measurement of that size)."""
        cap = max(1, BLOCK_BYTES // (4 * max(dim, 1)))
        if self.chosen is not None or self.batched is False:
            return min(self.chosen or BLOCK_CANDIDATES[-1], remaining), False
        if not self.warm:
            return min(WARMUP_ROWS, remaining, cap), False
        for size in BLOCK_CANDIDATES:
            if size <= cap and size not in self.per_row:
                return min(size, remaining), size <= remaining
        return min(cap, remaining), False  # not reached: every candidate measured chooses one

    def _measured(self, size: int, seconds: float, cap: int) -> None:
        self.per_row[size] = seconds / size
        tried = [s for s in BLOCK_CANDIDATES if s <= cap]
        if all(s in self.per_row for s in tried):
            best = min(self.per_row[s] for s in tried)
            self.chosen = min(s for s in tried if self.per_row[s] <= CHOICE_SLACK * best)
            log.debug("training: %d rows per block (seconds per row: %s)", self.chosen, self.per_row)

    def rows(
        self,
        loss: torch.Tensor,
        params: Sequence[torch.Tensor],
        layout: ParamLayout,
        out: torch.Tensor,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """``out[c] = d loss[c] / d params`` (computed at loss scale ``scale``, divided by it)."""
        root = loss.float()  # as GradScaler.scale: the product with the scale is float32
        n = root.numel()
        clock = choice_clock(root.device)
        cap = max(1, BLOCK_BYTES // (4 * max(layout.dim, 1)))
        c0 = 0
        self._reached = False
        while c0 < n:
            size, timed = self._next(n - c0, layout.dim)
            c1 = c0 + size
            t0 = clock()
            self._block(root, params, layout, out[c0:c1], c0, scale, c1 == n)
            if timed and self.batched is not False:
                if root.device.type == "cuda":
                    torch.cuda.synchronize(root.device)
                self._measured(size, clock() - t0, cap)
            elif size > 1 and self.batched:
                self.warm = True
            c0 = c1
        if not self._reached:  # every row zero: a step would apply only weight decay and momentum
            raise InputError(
                "loss: its graph reaches none of the parameters the rows are of (model= or the optimizer's): "
                "compute it from that model's outputs"
            )
        return out

    def _block(
        self,
        root: torch.Tensor,
        params: Sequence[torch.Tensor],
        layout: ParamLayout,
        dest: torch.Tensor,
        c0: int,
        scale: float,
        last: bool,
    ) -> None:
        b, n = dest.shape[0], root.numel()
        if b > 1 and self.batched is not False:
            cot = torch.zeros(b, n, dtype=root.dtype, device=root.device)
            cot[torch.arange(b), torch.arange(c0, c0 + b)] = scale
            # Until a batched backward has worked here, keep the graph: a failure midway must
            # leave it whole for the per-row fallback.
            keep = not last or self.batched is None
            try:
                grads = torch.autograd.grad(
                    root, list(params), grad_outputs=cot, retain_graph=keep, allow_unused=True, is_grads_batched=True
                )
            except RuntimeError as exc:
                if self.batched is not None:
                    raise
                self.batched = False
                log.info("training: batched VJPs refused by this graph (%s); one backward per row", str(exc)[:120])
            else:
                self.batched = True
                self._write(grads, layout, dest, scale)
                return
        for i in range(b):
            grads = torch.autograd.grad(
                root[c0 + i] * scale, list(params), retain_graph=not (last and i == b - 1), allow_unused=True
            )
            self._write([None if g is None else g.unsqueeze(0) for g in grads], layout, dest[i : i + 1], scale)

    def _write(
        self, grads: Sequence[torch.Tensor | None], layout: ParamLayout, dest: torch.Tensor, scale: float
    ) -> None:
        if all(g is None for g in grads):
            dest.zero_()
            return
        self._reached = True
        layout.flatten(grads, batch_dims=1, out=dest)
        if scale != 1.0:
            dest.div_(scale)
