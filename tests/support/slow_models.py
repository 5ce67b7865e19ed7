"""Models and data for fault tests: ordinary zoo models that take a known time per forward.

Ray workers import this module by path (``tests.support.slow_models:slow_mlp``), so tests
that use it must make the repository root importable on the workers (the Ray fixtures in
``tests/integration/conftest.py`` set PYTHONPATH for that).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from classgrad.workers import zoo


class Slow(nn.Module):
    """Wraps a model; every forward first sleeps ``delay_s`` so a job lasts long enough to be
    interrupted mid-way. The rows are exactly those of the wrapped model."""

    def __init__(self, inner: nn.Module, delay_s: float):
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.inner(x)


def slow_mlp(num_classes: int = 10, delay_s: float = 0.2, **mlp_kwargs) -> nn.Module:
    return Slow(zoo.mlp(num_classes, **mlp_kwargs), delay_s)
