"""The memory format of image inputs on the hook path, by a fixed rule.

Holds ``image_format`` (the rule) and ``ImageFormat`` (puts a run's image inputs in that format).
Channels-last is what convolutions and pooling run fastest in on a CPU (the partitioned engine's
CNN: forward and backward 1.5x faster) and with tensor cores, so a model with a 2-d convolution
gets its 4-D floating inputs channels-last, any other model gets them as given. A rule, not a
measurement: the format picks the convolution kernels, and rows from the kernels of two layouts
were seen to differ by 5e-4 relative (issue 29; on a CPU they agree to rounding: where one
kernel runs in TF32 on a GPU, 2^-11 is TF32's rounding). Chosen by timing, two actors of one
job (or a job and ``per_class_gradients``, or a resume) could choose differently and one store
mix both; and a first call now measures nothing.
"""

from __future__ import annotations

import torch
from torch import nn

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
        """``x`` in the format, when it is a 4-D floating tensor; anything else as it is."""
        if not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()):
            return x
        if self.format != "channels_last":
            return x
        self.gather = torch.channels_last
        return x.contiguous(memory_format=torch.channels_last)  # a no-op once batches are gathered so
