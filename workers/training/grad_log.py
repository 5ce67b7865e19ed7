"""``GradLog``: a training run's per-class gradient rows, summed over windows of steps into a store.

Holds ``GradLog``. Each step's rows (``PerClassGradScaler.step_batch`` returns them with their
class ids) are projected (``dim`` columns, a sparse sign sketch of the whole row: the same map
for every step, so a window's sum is the projection of the summed rows) and added into one
``C x dim`` accumulator on the rows' device, with their learning-rate-weighted copy, the classes'
sample counts and loss sums. When a step falls in the next window the finished window is copied
to the host, written (``classgrad.store.grad_log``) and only then marked done. Memory stays one
accumulator pair whatever the number of steps. A run restarted from a checkpoint at step ``s``
(a window boundary) passes ``start_step=s``: the windows from ``s`` on are dropped and
recomputed, never doubled.

Under ``torch.distributed`` (one ``GradLog`` per rank, each given its own batch's rows and
counts) a step's rows are weighted by each rank's share of the class's samples in the step (the
classes' counts summed over ranks once a step: ``C`` integers), and a finished window is summed
over ranks before rank 0 alone writes it: the log equals one process's over the concatenated
batches (each class's row of a step is the mean over all its samples in the step).

A Hugging Face or Lightning ``Trainer`` fills one through its callback (``hf_callback``,
``lightning_callback``). Not yet here (issue 48): rows from the training step's own backward
without a second pass, ``score``/``plot`` on a log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from classgrad.config import ProjectionConfig
from classgrad.errors import InputError
from classgrad.store.grad_log import GradLogStore, LogSpec, open_log
from classgrad.workers.layout import ParamLayout
from classgrad.workers.structures import FALLBACK_STRUCTURE, ProjectionOptions

log = logging.getLogger(__name__)


class GradLog:
    """Per-class rows of every step, summed over windows of ``window`` steps into ``url``.

    ``dim``: the stored width (a sketch of each row; None: whole rows); ``params``: the name
    patterns of the parameters in a row (as ``per_class_gradients``); ``start_step``: the step
    a resumed run starts at (a multiple of ``window``; windows from there on are recomputed)."""

    def __init__(
        self,
        url: str,
        model: nn.Module,
        num_classes: int,
        *,
        window: int = 10,
        dim: int | None = 4096,
        seed: int = 0,
        params: Sequence[str] | None = None,
        start_step: int = 0,
        storage_options: dict | None = None,
        overwrite: bool = False,
    ):
        if not isinstance(window, int) or window < 1:
            raise InputError(f"GradLog: window must be an integer >= 1, got {window!r}")
        if not isinstance(start_step, int) or start_step < 0 or start_step % window:
            raise InputError(
                f"GradLog: start_step must be a multiple of window ({window}) >= 0, got {start_step!r}: resume "
                "from a checkpoint at a window boundary (a window's steps never come from two runs)"
            )
        self.layout = ParamLayout.from_model(model, include=list(params or ()))
        self.num_classes = num_classes
        self.window = window
        self.projector = None
        record = None
        if dim is not None:
            config = ProjectionConfig.model_validate({"dim": dim, "seed": seed, "structure": FALLBACK_STRUCTURE})
            options = ProjectionOptions.resolve(config)
            assert options is not None  # a dim is given
            self.projector = options.finished_projector(self.layout.slots, self.layout.dim)
            record = self.projector.describe()
        width = self.layout.dim if self.projector is None else self.projector.out_dim
        spec = LogSpec(
            num_classes=num_classes,
            width=width,
            window=window,
            layout=[[s.name, list(s.shape)] for s in self.layout.slots],
            projection=record,
            model=type(model).__qualname__,
        )
        self.distributed = dist.is_available() and dist.is_initialized()
        self.writer = not self.distributed or dist.get_rank() == 0  # one rank writes the log
        self.store: GradLogStore | None = None
        if self.writer:
            self.store = open_log(url, spec, storage_options=storage_options, overwrite=overwrite)
            self.store.resume_at(start_step)
        if self.distributed:
            dist.barrier()  # the log exists, resumed, before any rank adds to it
        self.device = next(model.parameters()).device
        self._current: int | None = None  # the window being summed
        self._steps = (0, 0)
        self._last_step = start_step - 1
        self._sums = torch.zeros(num_classes, width, device=self.device)
        self._lr_sums = torch.zeros_like(self._sums)
        self._count = torch.zeros(num_classes, dtype=torch.int64, device=self.device)
        self._loss = torch.zeros(num_classes, dtype=torch.float64, device=self.device)

    def add(
        self,
        step: int,
        rows: torch.Tensor,
        class_ids: torch.Tensor,
        *,
        lr: float = 1.0,
        counts: torch.Tensor | None = None,
        losses: torch.Tensor | None = None,
    ) -> None:
        """Step ``step``'s rows ``[k, D]`` of ``class_ids`` (distinct), at learning rate ``lr``;
        ``counts``: each class's samples in the step (default 1); ``losses``: each class's mean
        loss in the step (its sum over the class's samples is logged)."""
        if step <= self._last_step:
            raise InputError(f"GradLog: step {step} after step {self._last_step}: steps must increase")
        if rows.ndim != 2 or rows.shape[1] != self.layout.dim or len(rows) != len(class_ids):
            raise InputError(
                f"GradLog: rows must be [len(class_ids), {self.layout.dim}], got {list(rows.shape)} "
                f"for {len(class_ids)} class ids"
            )
        w = step // self.window
        if self._current is not None and w != self._current:
            self._write()
        if self._current is None:
            self._current, self._steps = w, (step, step)
        self._last_step = step
        self._steps = (self._steps[0], step + 1)
        ids = class_ids.to(self.device, torch.int64)
        projected = rows.float() if self.projector is None else self.projector.project(rows.float())
        n = torch.ones(len(ids), dtype=torch.int64, device=self.device) if counts is None else counts.to(self.device)
        if self.distributed:  # each rank's row weighted by its share of the class's samples
            total = torch.zeros(self.num_classes, dtype=torch.int64, device=self.device).index_add_(0, ids, n.long())
            dist.all_reduce(total)
            projected = projected * (n.double() / total[ids].double()).float().unsqueeze(1)
        # The class ids of a step are distinct: each index is added once, in any order, exactly.
        self._sums.index_add_(0, ids, projected)
        self._lr_sums.index_add_(0, ids, projected * lr)
        self._count.index_add_(0, ids, n.to(torch.int64))
        if losses is not None:
            self._loss.index_add_(0, ids, losses.detach().to(self.device, torch.float64) * n.to(torch.float64))

    def close(self) -> None:
        """Write the window in progress (a last, shorter window at the end of training)."""
        if self._current is not None:
            self._write()

    def _write(self) -> None:
        assert self._current is not None
        w = self._current
        if self.distributed:
            for t in (self._sums, self._lr_sums, self._count, self._loss):
                dist.all_reduce(t)
        if self.store is not None:  # rank 0 (or the one process) writes it
            self._write_window(w)
        if self.distributed:
            dist.barrier()  # every rank goes on once the window is written and marked done
        self._reset()

    def _write_window(self, w: int) -> None:
        assert self.store is not None
        self.store.write_window(
            w,
            self._sums.cpu().numpy(),
            self._lr_sums.cpu().numpy(),
            self._count.cpu().numpy(),
            self._loss.cpu().numpy(),
            self._steps,
        )
        self.store.mark_done(w)  # after its chunks are written: a crash before leaves it absent
        log.debug("grad log: window %d (steps %d-%d) written", w, self._steps[0], self._steps[1] - 1)

    def _reset(self) -> None:
        for t in (self._sums, self._lr_sums, self._count, self._loss):
            t.zero_()
        self._current = None

    def __enter__(self) -> GradLog:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
