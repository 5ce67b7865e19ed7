"""The memory format of image inputs on the hook path, chosen from the first real runs.

Holds ``ImageFormat``: channels-last is often much faster for convolutions and pooling on a CPU,
or with tensor cores; which one runs a model faster is decided from its first runs themselves
(real work, no extra passes) and kept per process (``choices.INPUT_FORMAT``). The format never
changes a row, only how fast it comes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from classgrad.workers.engines import choices
from classgrad.workers.engines.base import EngineStats

log = logging.getLogger(__name__)


class ImageFormat:
    """Puts image inputs of one model in the faster memory format, measuring it on the way."""

    def __init__(self, model: nn.Module, device: torch.device, precision: str, stats: EngineStats):
        self.model, self.device, self.precision, self.stats = model, device, precision, stats
        # Once channels-last inputs are chosen, batches are gathered that way (one pass, not two).
        self.gather: torch.memory_format | None = None

    def apply(self, x: object) -> tuple[object, list | None]:
        """``x`` in the chosen format, and ``trial``: while the format is being measured, a list
        to append this run's seconds per sample to (None otherwise)."""
        if not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()):
            return x, None
        key = (id(self.model), tuple(x.shape[1:]), x.dtype, str(self.device), self.precision)
        fmt, trial = choices.INPUT_FORMAT.get(key), None
        if fmt is None:
            trials = choices.FORMAT_TIMES.setdefault(key, [])
            if len(trials) >= choices.FORMAT_TRIALS:
                best: dict[str, float] = {}
                for f, *t in trials[1:]:  # the first run pays one-off costs
                    best[f] = min([best.get(f, float("inf")), *t])
                fmt = choices.INPUT_FORMAT[key] = min(best, key=best.__getitem__)
                note = "partitioned: image inputs {} (seconds per sample: {})".format(
                    fmt,
                    {f: f"{t:.2e}" for f, t in best.items()},
                )
                log.info(note)
                self.stats.notes.append(note)
            else:
                fmt = ("contiguous", "channels_last")[len(trials) % 2]
                trial = [fmt]
                trials.append(trial)
        if trial is None and fmt == "channels_last":
            self.gather = torch.channels_last
        if fmt == "channels_last":  # a no-op once batches are gathered channels-last
            x = x.contiguous(memory_format=torch.channels_last)
        return x, trial
