"""``GradLogLightningCallback``: a Lightning ``Trainer`` logs its per-class rows into a ``GradLog``.

Holds ``GradLogLightningCallback``, a ``lightning.pytorch.Callback`` that attaches to an
unmodified ``Trainer`` and ``LightningModule``: ``on_train_batch_start`` keeps the step's batch
(on the module's device; an ``(inputs, labels)`` pair, a dict holding ``labels`` whose other
per-sample tensors are the forward's keyword arguments, or what ``split_batch(batch)`` makes of
any other batch); before the optimizer steps (``on_before_optimizer_step``: at the step's
parameters, after the backward and any unscaling, before clipping) the batch's per-class rows
(mean cross-entropy of each class present, through the module's own forward, which must return
``[N, num_classes]`` logits) go into the log with the step's learning rate
(``callback_step.log_step``, shared with the Hugging Face callback: the step's gradients and the
module's buffers put back after the pass). The log opens at ``trainer.global_step`` (a fit
resumed from a checkpoint starts there: a multiple of the log's window) and closes at the end of
training.

As for ``GradLogCallback``: the rows take a pass of their own over the batch, in the module's
training mode and outside the step's autocast; with active dropout that pass draws its own masks
(with dropout off, the training is untouched). Refused in one line at the start:
``accumulate_grad_batches > 1`` (the log takes one batch a step) and manual optimization (no one
optimizer step a batch for the rows to belong to). Lightning is imported here only: the rest of
classgrad runs without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from classgrad.errors import InputError
from classgrad.workers.training.callback_step import labelled_batch, log_step
from classgrad.workers.training.grad_log import GradLog

log = logging.getLogger(__name__)

SplitBatch = Callable[[Any], tuple[Any, torch.Tensor]]


class GradLogLightningCallback(Callback):
    """``Trainer(..., callbacks=[GradLogLightningCallback(url, num_classes, window=10, dim=4096)])``;
    ``split_batch(batch) -> (inputs, labels)`` for a batch that is neither an ``(inputs, labels)``
    pair nor a dict with ``labels``; the other keyword arguments are ``GradLog``'s."""

    def __init__(self, url: str, num_classes: int, *, split_batch: SplitBatch | None = None, **log_options: Any):
        self.url = url
        self.num_classes = num_classes
        self.split_batch = split_batch
        self.log_options = log_options
        self.log: GradLog | None = None
        self._batch: tuple[Any, torch.Tensor] | None = None
        self._warned = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise InputError(
                f"GradLogLightningCallback: accumulate_grad_batches={trainer.accumulate_grad_batches}: the log "
                "takes one batch a step (set it to 1)"
            )
        if not pl_module.automatic_optimization:
            raise InputError(
                "GradLogLightningCallback: manual optimization: the log needs one optimizer step a batch "
                "(automatic_optimization=True)"
            )
        self.log = GradLog(self.url, pl_module, self.num_classes, start_step=trainer.global_step, **self.log_options)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = self._split(batch)

    def _split(self, batch: Any) -> tuple[Any, torch.Tensor] | None:
        if self.split_batch is not None:
            return self.split_batch(batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
            return batch[0], batch[1].detach()
        if isinstance(batch, Mapping):
            return labelled_batch(batch)
        return None

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.log is None:
            return
        if self._batch is None:
            if not self._warned:
                log.warning(
                    "GradLogLightningCallback: step %d's batch is neither (inputs, labels) nor a dict with labels: "
                    "not logged (give split_batch=)",
                    trainer.global_step,
                )
                self._warned = True
            return
        inputs, labels = self._batch
        self._batch = None
        log_step(self.log, pl_module, inputs, labels, optimizer, trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
