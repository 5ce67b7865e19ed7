"""The memory format of image inputs on the hook path, by a fixed rule.

Holds ``image_format`` (the rule) and ``ImageFormat`` (puts a run's image inputs in that format).
Channels-last is what convolutions and pooling run fastest in on a CPU (the partitioned engine's
CNN: forward and backward 1.5x faster) and with tensor cores, so a model with a 2-d convolution
gets its 4-D floating inputs channels-last (a bare batch, or inside a dict, tuple or list: a
Hugging Face model's ``pixel_values``), any other model gets them as given. A rule, not a
measurement: the format picks the convolution kernels, and rows from the kernels of two layouts
were seen to differ by 5e-4 relative (issue 29; on a CPU they agree to rounding: where one
kernel runs in TF32 on a GPU, 2^-11 is TF32's rounding). Chosen by timing, two actors of one
job (or a job and ``per_class_gradients``, or a resume) could choose differently and one store
mix both; and a first call now measures nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from classgrad.workers.probe import has_image, in_memory_format

__all__ = ["ImageFormat", "image_format"]


def image_format(model: nn.Module) -> str:
    """``"channels_last"`` for a model with a 2-d convolution, else ``"contiguous"`` (as given)."""
    return "channels_last" if any(isinstance(m, nn.Conv2d) for m in model.modules()) else "contiguous"


class ImageFormat:
    """Puts image inputs of one model in the format of ``image_format``."""

    def __init__(self, model: nn.Module):
        self.format = image_format(model)
        # Once a batch held channels-last images, batches are gathered that way (one pass, not two).
        self.gather: torch.memory_format | None = None

    def apply(self, x: object) -> object:
        """``x`` with its 4-D floating tensors in the format: ``x`` itself, or any inside a dict,
        tuple or list (a Hugging Face model's ``pixel_values``); anything else as it is."""
        if self.format != "channels_last" or not has_image(x):
            return x
        self.gather = torch.channels_last
        return in_memory_format(x, torch.channels_last)  # a no-op once batches are gathered so
