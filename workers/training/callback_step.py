"""What the training-framework callbacks share: a step's labelled batch, and its rows into a log.

Holds:
- ``labelled_batch``: a batch given as keyword arguments (a tokenizer's output with ``labels``,
  as a Hugging Face model's forward or a Lightning dict batch holds it) split into the model's
  inputs (the tensors of a sample a row) and its labels; None without a ``labels`` tensor.
- ``log_step``: one step's rows of such a batch at the model's current parameters (before the
  optimizer steps), by ``GradLog.add_batch`` (sketched inside a backward of their own where the
  model allows, else ``PerClassGradScaler.step_batch(..., update_grad=False)``), with the
  optimizer's learning rate; the step's own gradients (``add_batch`` leaves them) and the
  model's buffers (BatchNorm's running statistics, which the rows' pass would move a second
  time) are put back after the pass, so that the training is the one without the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from classgrad.workers.training.grad_log import GradLog


def labelled_batch(batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """``(inputs, labels)`` of a keyword batch holding a ``labels`` tensor (detached), else None."""
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.ndim == 0:
        return None
    # The batch's tensors (a sample a row), not a trainer's extras (num_items_in_batch).
    n = len(labels)
    inputs = {
        k: v.detach()
        for k, v in batch.items()
        if k != "labels" and isinstance(v, torch.Tensor) and v.ndim and len(v) == n
    }
    return inputs, labels.detach()


def log_step(
    log: GradLog,
    model: nn.Module,
    inputs: Any,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    step: int,
) -> None:
    """Step ``step``'s rows of the batch ``(inputs, labels)`` at ``model``'s parameters into ``log``
    (``GradLog.add_batch``: sketched inside a backward of their own where it can), at the learning
    rate of ``optimizer``'s first group; ``.grad`` and buffers left as they were."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # BatchNorm: moved once, by the step
    with torch.enable_grad():  # a framework may call its hook under no_grad (an optimizer's step)
        log.add_batch(step, model, inputs, labels, optimizer)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
