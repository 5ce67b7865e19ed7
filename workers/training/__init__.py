"""Per-class gradients inside a user's own training loop.

Holds nothing but re-exports: ``GradLog`` (``grad_log``: the rows of every step summed over
windows of steps into a store) and ``PerClassGradScaler`` (``scaler``): the ``GradScaler`` step
of a training loop that also gives every class's gradient row, by VJPs of the user's per-class
loss vector in blocks (``loss_rows``) or, for a batch's mean cross-entropy per class, by the
partitioned engine's hook path (``batch_rows``). The ``Trainer`` callbacks (``hf_callback``,
``lightning_callback``) are imported on their own: they need transformers or lightning.
"""

from classgrad.workers.training.grad_log import GradLog
from classgrad.workers.training.scaler import PerClassGradScaler

__all__ = ["GradLog", "PerClassGradScaler"]
