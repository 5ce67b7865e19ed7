"""``GradLog``: a training run's per-class gradient rows, summed over windows of steps into a store.

Holds ``GradLog``. A step's rows reach it three ways: ``step`` (the training step and its rows
from one forward and one backward, the rows sketched inside it: ``sketched_rows``), ``add_batch``
(a batch's rows at the current parameters, sketched inside a backward of their own: what a
framework's callback logs) and ``add`` (whole rows, e.g. ``PerClassGradScaler.step_batch``'s,
sketched after). The map is one ``tensorsketch`` map of the model's layout (``dim`` columns,
planned once: the same for every step and every way in, so a window's sum is the map of the
summed rows; logs made before 2026-12-05 resume with ``structure="sketch"``, a sparse sign
sketch of whole rows). Rows go into one ``C x dim`` accumulator on the model's device, with their
learning-rate-weighted copy, the classes' sample counts and loss sums. When a step falls in the
next window the finished window is copied to the host, written (``classgrad.store.training_log.log_store``) and
only then marked done (``window_sums``: on a GPU behind the next window's steps, on a writer
thread).
Memory stays one accumulator pair (two with the writer thread) whatever the number of steps. A
run restarted from a checkpoint at step ``s`` (a window boundary) passes ``start_step=s``: the
windows from ``s`` on are dropped and recomputed, never doubled.

Under ``torch.distributed`` (one ``GradLog`` per rank, each given its own batch's rows and
counts) a step's rows are weighted by each rank's share of the class's samples in the step (the
classes' counts summed over ranks once a step: ``C`` integers), and a finished window is summed
over ranks before rank 0 alone writes it: the log equals one process's over the concatenated
batches (each class's row of a step is the mean over all its samples in the step).

A Hugging Face or Lightning ``Trainer`` fills one through its callback (``hf_callback``,
``lightning_callback``).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from classgrad.config import ProjectionConfig
from classgrad.errors import InputError
from classgrad.store.training_log.log_store import (
    LOG_CODECS,
    LOG_DTYPES,
    GradLogStore,
    LogSpec,
    is_log,
    open_log,
    open_log_reader,
)
from classgrad.workers.layout import ParamLayout
from classgrad.workers.projection import (
    DEFAULT_STRUCTURE,
    STRUCTURES,
    RowProjector,
    recorded_structure,
    resolve_projection,
)
from classgrad.workers.training.batch_rows import batch_loss_vector
from classgrad.workers.training.scaler import PerClassGradScaler
from classgrad.workers.training.sketched_rows import BatchRows, LogMap
from classgrad.workers.training.window_sums import WindowSums

log = logging.getLogger(__name__)


class GradLog:
    """Per-class rows of every step, summed over windows of ``window`` steps into ``url``.

    ``dim``: the stored width (a sketch of each row; None: whole rows); ``structure``: the map,
    any registered projection structure (None: a resumed log's own, else ``tensorsketch``; logs
    made before 2026-12-05 hold ``sketch``); one that projects inside the backward plans its map
    from the model alone, nothing measured (``kronecker``: the split by size); ``params``: the name patterns of
    the parameters in a row (as ``per_class_gradients``); ``start_step``: the step a resumed run
    starts at (a multiple of ``window``; windows from there on are recomputed; needed to reopen a
    log that holds windows, and refused when a window before it was never written); ``background``:
    a finished window is written while the next one's steps run (``window_sums``; two sets of
    sums in memory), else the step that ends a window waits for its write (default: in the
    background when the model is on a GPU); ``dtype``: how the windows' sums are stored,
    ``float32`` or ``bfloat16`` (half the bytes, 8 significant bits: benchmarks/RESULTS.md has
    its error against float32); readers get float32 either way; ``codec``: how a new log stores
    them, ``none`` (only the rows of the classes a window saw, in shards of one-row chunks: the
    fewest bytes, and the fastest write and read through this log's reader) or ``zstd`` (dense
    compressed chunks: what zarr's own pipeline, and so xarray and dask, reads fastest)."""

    def __init__(
        self,
        url: str,
        model: nn.Module,
        num_classes: int,
        *,
        window: int = 10,
        dim: int | None = 4096,
        seed: int = 0,
        structure: str | None = None,
        params: Sequence[str] | None = None,
        start_step: int | None = None,
        storage_options: dict | None = None,
        overwrite: bool = False,
        background: bool | None = None,
        dtype: str = "float32",
        codec: str = "none",
    ):
        if not isinstance(window, int) or window < 1:
            raise InputError(f"GradLog: window must be an integer >= 1, got {window!r}")
        if dtype not in LOG_DTYPES:
            raise InputError(f"GradLog: dtype must be one of {', '.join(LOG_DTYPES)}, got {dtype!r}")
        if codec not in LOG_CODECS:
            raise InputError(f"GradLog: codec must be one of {', '.join(LOG_CODECS)}, got {codec!r}")
        if start_step is not None and (not isinstance(start_step, int) or start_step < 0 or start_step % window):
            raise InputError(
                f"GradLog: start_step must be a multiple of window ({window}) >= 0, got {start_step!r}: resume "
                "from a checkpoint at a window boundary (a window's steps never come from two runs)"
            )
        self.layout = ParamLayout.from_model(model, include=list(params or ()))
        self.params = list(params or ())
        self._row_scaler = PerClassGradScaler(num_classes=num_classes)  # the routes without the map
        self.num_classes = num_classes
        self.window = window
        self.projector: RowProjector | None = None
        self.map: LogMap | None = None  # rows sketched inside a backward (``step``, ``add_batch``)
        if dim is not None:
            # A log being resumed keeps its map; ``sketch``: logs made before 2026-12-05.
            structure = structure or (None if overwrite else _recorded_structure(url, storage_options))
            structure = structure or DEFAULT_STRUCTURE
            if structure not in STRUCTURES:
                raise InputError(
                    f"GradLog: structure must be one of {', '.join(STRUCTURES.names())}, got {structure!r}"
                )
            config = ProjectionConfig.model_validate({"dim": dim, "seed": seed, "structure": structure})
            projection = resolve_projection(config)
            assert projection is not None  # a dim is given
            if projection.spec.in_backward:
                self.projector = self.map = LogMap(model, self.layout, projection)
            else:
                self.projector = projection.finished_projector(self.layout.slots, self.layout.dim)
        record = None if self.projector is None else self.projector.describe()
        width = self.layout.dim if self.projector is None else self.projector.out_dim
        spec = LogSpec(
            num_classes=num_classes,
            width=width,
            window=window,
            layout=[[s.name, list(s.shape)] for s in self.layout.slots],
            projection=record,
            model=type(model).__qualname__,
            dtype=dtype,
        )
        self.distributed = dist.is_available() and dist.is_initialized()
        self.writer = not self.distributed or dist.get_rank() == 0  # one rank writes the log
        self.store: GradLogStore | None = None
        if self.writer:
            # The log's lease, for this process: a second writer is refused while this one lives.
            writer_id = f"gradlog-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            self.store = open_log(
                url, spec, storage_options=storage_options, overwrite=overwrite, writer_id=writer_id, codec=codec
            )
            try:
                if start_step is None and self.store.done:  # start_step 0 would drop every window
                    raise InputError(
                        f"GradLog: {url} already holds windows {self.store.done[0]}-{self.store.done[-1]}: pass "
                        "start_step= (the step this run resumes at, a multiple of window), or overwrite=True "
                        "to start the log over"
                    )
                self.store.resume_at(start_step or 0)
            except BaseException:
                self.store.close()  # the lease back: nothing was written
                raise
        if self.distributed:
            dist.barrier()  # the log exists, resumed, before any rank adds to it
        self.device = next(model.parameters()).device
        self._last_step = (start_step or 0) - 1
        # On a GPU the host's cores are free to write while the device computes; on a CPU the
        # writer competes with the step's own threads (2 cores: each step slower, window 1 and 10).
        background = self.device.type != "cpu" if background is None else background
        self.windows = WindowSums(
            self.store, num_classes, width, self.device, distributed=self.distributed, background=background
        )

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
        if rows.ndim != 2 or rows.shape[1] != self.layout.dim or len(rows) != len(class_ids):
            raise InputError(
                f"GradLog: rows must be [len(class_ids), {self.layout.dim}], got {list(rows.shape)} "
                f"for {len(class_ids)} class ids"
            )
        projected = rows.float() if self.projector is None else self.projector.project(rows.float())
        self._accumulate(step, projected, class_ids, lr, counts, losses)

    def step(
        self,
        step: int,
        model: nn.Module,
        inputs: Any,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        *,
        clip_grad: float | None = None,
        output: str | int | None = None,
    ) -> float:
        """Training step ``step`` on the batch ``(inputs, labels)``, logged: the gradient of the
        batch's mean cross-entropy into ``.grad`` (added, as ``backward`` does: zero it first),
        clipped to ``clip_grad`` (total norm), the optimizer's step (skipped, with a warning,
        when a loss or row is not finite), and each class's row (the mean cross-entropy of its
        samples, at the step's parameters) into the log at the optimizer's learning rate. The
        batch's mean loss is returned (NaN for a skipped step).

        With a sketched log (``dim``, structure ``tensorsketch``) and a model that treats samples
        independently (no dropout or train-mode BatchNorm) outside fp16, one forward and one
        backward serve both: the rows are sketched inside it (``sketched_rows``). Otherwise the
        batch takes ``PerClassGradScaler``'s general route (one forward, VJPs of the class
        losses), whose rows are then sketched whole by the same map."""
        if self.distributed:
            raise InputError(
                "GradLog.step under torch.distributed: DistributedDataParallel averages the gradient in its own "
                "backward, which this step does not run: take the step yourself and log with add_batch"
            )
        lr = float(optimizer.param_groups[0]["lr"])
        params = self.layout.parameters(model)
        if len(params) != sum(1 for p in model.parameters() if p.requires_grad):
            raise InputError(
                "GradLog.step trains every trainable parameter, and this log's rows hold some (params=...): "
                "take the step yourself and log its rows with add_batch"
            )
        batch = None
        if self.map is not None:
            batch = self.map.rows(model, inputs, labels, num_classes=self.num_classes, output=output, step=True)
        if batch is None:
            return self._general(step, model, inputs, labels, optimizer, lr, output, train=True, clip_grad=clip_grad)
        if not self._log_batch(step, batch, lr):
            return float("nan")  # the optimizer's step skipped too, as GradScaler skips it
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_grad)
        optimizer.step()
        return float((batch.losses.double() * batch.counts).sum() / batch.counts.sum())

    def add_batch(
        self,
        step: int,
        model: nn.Module,
        inputs: Any,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        *,
        output: str | int | None = None,
    ) -> None:
        """Step ``step``'s rows of the batch ``(inputs, labels)`` at ``model``'s parameters, at the
        learning rate of ``optimizer``'s first group, without stepping: what a framework's
        callback logs before its optimizer steps. Sketched inside a backward of their own (no
        whole row formed) where ``step`` would be; else by ``PerClassGradScaler``'s general
        route. ``.grad`` is left as it was; a batch with a non-finite loss or row is not logged
        (a warning says so)."""
        lr = float(optimizer.param_groups[0]["lr"])
        batch = (
            None
            if self.map is None
            else self.map.rows(model, inputs, labels, num_classes=self.num_classes, output=output)
        )
        if batch is None:
            self._general(step, model, inputs, labels, optimizer, lr, output, train=False)
        else:
            self._log_batch(step, batch, lr)

    def _log_batch(self, step: int, batch: BatchRows, lr: float) -> bool:
        """A batch's sketched rows into the log; False (logged as an empty step) when not finite."""
        if not batch.finite:
            self._skip(step, lr)
            return False
        self._accumulate(step, batch.rows, batch.class_ids, lr, batch.counts, batch.losses)
        return True

    def _general(
        self,
        step: int,
        model: nn.Module,
        inputs: Any,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        lr: float,
        output: str | int | None,
        *,
        train: bool,
        clip_grad: float | None = None,
    ) -> float:
        """``PerClassGradScaler``'s general route: one forward of the batch as given, the class
        losses' rows by VJPs, logged; with ``train`` the step on their count-weighted sum (the
        batch's mean loss). The batch's mean loss (NaN when not finite: nothing stepped or logged)."""
        loss, class_ids = batch_loss_vector(model, inputs, labels, num_classes=self.num_classes, output=output)
        counts = torch.bincount(labels.detach().cpu(), minlength=self.num_classes)[class_ids]
        weights = (counts.double() / counts.sum()).to(loss.device, loss.dtype)
        scaler = self._row_scaler
        rows = scaler(
            loss,
            optimizer,
            model=model,
            clip_grad=clip_grad,
            update_grad=train,
            aggregate=weights,
            params=self.params or None,
            class_ids=class_ids,
        )
        # Without the step the scaler reads no sum of the rows: one read of their finiteness here.
        if scaler.found_inf if train else not bool(torch.isfinite(rows).all()):
            self._skip(step, lr)
            return float("nan")
        losses = loss.detach().cpu()
        self.add(step, rows, class_ids, lr=lr, counts=counts, losses=losses)
        return float((losses.double() * counts).sum() / counts.sum())

    def _skip(self, step: int, lr: float) -> None:
        """Step ``step`` had a non-finite loss or row: logged with no rows (under
        ``torch.distributed`` every rank still takes part in the step's count reduction)."""
        log.warning("training log: step %d has a non-finite loss or row: not logged", step)
        none = torch.zeros(0, dtype=torch.int64)
        self._accumulate(
            step, torch.zeros(0, self.windows.sums.rows.shape[1], device=self.device), none, lr, none, None
        )

    def _accumulate(
        self,
        step: int,
        projected: torch.Tensor,
        class_ids: torch.Tensor,
        lr: float,
        counts: torch.Tensor | None,
        losses: torch.Tensor | None,
    ) -> None:
        """Step ``step``'s stored-width rows of ``class_ids`` into the window's sums."""
        if step <= self._last_step:
            raise InputError(f"GradLog: step {step} after step {self._last_step}: steps must increase")
        self.windows.start(step // self.window, step)
        self._last_step = step
        if self.store is not None:
            self.store.keep_alive()  # renews the log's lease every third of its TTL
        ids = class_ids.to(self.device, torch.int64)
        n = torch.ones(len(ids), dtype=torch.int64, device=self.device) if counts is None else counts.to(self.device)
        if self.distributed:  # each rank's row weighted by its share of the class's samples
            total = torch.zeros(self.num_classes, dtype=torch.int64, device=self.device).index_add_(0, ids, n.long())
            dist.all_reduce(total)
            projected = projected * (n.double() / total[ids].double()).float().unsqueeze(1)
        self.windows.add(ids, projected, lr, n, losses)

    def close(self) -> None:
        """Write the window in progress (a last, shorter window at the end of training), wait
        for every write, and give the log's lease back."""
        try:
            self.windows.close()
        finally:
            if self.store is not None:
                self.store.close()

    def __enter__(self) -> GradLog:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the window in progress is not written (its steps are recomputed on resume)
            try:
                self.windows.abort()
            finally:
                if self.store is not None:
                    self.store.close()


def _recorded_structure(url: str, storage_options: dict | None) -> str | None:
    """The structure of the log already at ``url`` (None: no log there, or whole rows)."""
    if not is_log(url, storage_options=storage_options):
        return None
    record = open_log_reader(url, storage_options=storage_options).spec.projection
    return recorded_structure(record)
