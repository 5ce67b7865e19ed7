"""``GradLogCallback``: a Hugging Face ``Trainer`` logs its per-class rows into a ``GradLog``.

Holds ``GradLogCallback``, a ``transformers.TrainerCallback`` that attaches to an unmodified
``Trainer``: a forward pre-hook on the model keeps the training batch of the step (its inputs
and ``labels``); before the optimizer steps (``on_pre_optimizer_step``, at the step's
parameters) the batch's per-class rows (mean cross-entropy of each class present) go into the
log with the step's learning rate (``callback_step.log_step``, shared with the Lightning
callback: ``GradLog.add_batch``, sketched inside a backward of their own where the model
allows); the log is closed at the end of training and resumes at the trainer's ``global_step``
when training resumes from a checkpoint (a multiple of the log's window).

The rows take a pass of their own over the batch (the Trainer's backward is its own; a plain
loop gets both from one with ``GradLog.step``), in the model's training mode; the step's
gradients and the model's buffers (BatchNorm's running statistics, which that pass would move a
second time) are put back after it. With active
dropout the pass draws its own masks, which moves the RNG the training then uses (with dropout
off, the training is untouched). Refused in one line at the start: gradient accumulation (the
log takes one batch a step), label smoothing (the Trainer then keeps the labels from the
model), several GPUs in one process (``DataParallel`` splits the batch across replicas). A step
whose forward saw no ``labels`` is said once in the log's warning, not logged silently.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from classgrad.errors import InputError
from classgrad.workers.training.callback_step import labelled_batch, log_step
from classgrad.workers.training.grad_log import GradLog

log = logging.getLogger(__name__)


class GradLogCallback(TrainerCallback):
    """``Trainer(..., callbacks=[GradLogCallback(url, num_classes, window=10, dim=4096)])``; the
    keyword arguments are ``GradLog``'s."""

    def __init__(self, url: str, num_classes: int, **log_options: Any):
        self.url = url
        self.num_classes = num_classes
        self.log_options = log_options
        self.log: GradLog | None = None
        self._batch: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
        self._hook: Any = None
        self._warned = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        if args.gradient_accumulation_steps != 1:
            raise InputError(
                f"GradLogCallback: gradient_accumulation_steps={args.gradient_accumulation_steps}: the log "
                "takes one batch a step (set it to 1)"
            )
        if getattr(args, "label_smoothing_factor", 0.0):
            raise InputError("GradLogCallback: label_smoothing_factor > 0 keeps the labels from the model's forward")
        if getattr(args, "n_gpu", 1) > 1:
            raise InputError("GradLogCallback: several GPUs in one process (DataParallel): use torch.distributed")
        assert model is not None
        self.log = GradLog(self.url, model, self.num_classes, start_step=state.global_step, **self.log_options)
        self._hook = model.register_forward_pre_hook(self._keep_batch, with_kwargs=True)

    def _keep_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            batch = labelled_batch(kwargs)
            if batch is not None:
                self._batch = batch

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.log is None:
            return
        if self._batch is None:
            if not self._warned:
                log.warning("GradLogCallback: step %d's forward got no labels= tensor: not logged", state.global_step)
                self._warned = True
            return
        inputs, labels = self._batch
        self._batch = None
        log_step(self.log, kw["model"], inputs, labels, kw["optimizer"], state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.log is not None:
            self.log.close()
            self.log = None
