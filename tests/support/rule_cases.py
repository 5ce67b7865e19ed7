"""Shared by the layer-rule tests: the partitioned engine's rows next to the float64 reference
engine's, and the check that the hook path (not a fallback) made them.

Holds ``BATCH_SIZE``, ``rows_and_reference``, ``assert_hook_path``, ``token_probe``, ``Tokens``
and ``Scale`` (a user's layer with raw parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from classgrad.workers import zoo
from classgrad.workers.gradients import build_engine
from tests.support.engine_cases import EMPTY_CLASS, NUM_CLASSES, fell_back

BATCH_SIZE = 8  # several runs of classes, padded ones among them, and classes done alone


def rows_and_reference(model: nn.Module, data, params=None, precision: str = "fp32"):
    """(partitioned engine, its rows, the float64 reference engine's rows)."""
    eng = build_engine(
        model,
        data,
        num_classes=NUM_CLASSES,
        engine="partitioned",
        batch_size=BATCH_SIZE,
        params=params,
        precision=precision,
    )
    got = eng.compute(range(NUM_CLASSES)).rows
    ref = (
        build_engine(
            copy.deepcopy(model).double(),
            data,
            num_classes=NUM_CLASSES,
            engine="reference",
            batch_size=BATCH_SIZE,
            params=params,
        )
        .compute(range(NUM_CLASSES))
        .rows
    )
    return eng, got, ref


def assert_hook_path(eng, types: Iterable[type]) -> None:
    """The rows came from the hook path (no fallback, the first-run check passed), with rules for
    exactly ``types`` and no parameter left to a module-VJP unit."""
    assert eng._hooked is not None and eng._hooked.checked and not fell_back(eng), eng.stats.notes
    assert {r.module_type for r in eng._hooked.plan.rules.values()} == set(types)
    assert not eng._hooked.plan.units, eng.stats.notes


def token_probe(vocab: int, seq_len: int, pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Imbalanced classes of token ids, one class empty; with ``pad``, every third sample ends in a
    run of ``pad`` tokens (its padding mask) and one sample is padding only."""
    x, y = zoo.synthetic_probe(
        NUM_CLASSES, 3, kind="tokens", vocab=vocab, seq_len=seq_len, imbalance=1.0, empty_classes=[EMPTY_CLASS], seed=3
    )
    if pad is not None:
        x[::3, seq_len // 2 :] = pad
        x[1] = pad
    return x, y


class Tokens(nn.Module):
    """``[N, F]`` -> ``[N, shape...]``: gives the next layer several positions per sample."""

    def __init__(self, *shape: int):
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)


class Scale(nn.Module):
    """A user's layer: ``x * weight + bias``, per feature (no built-in rule: a module-VJP unit
    until a test registers one)."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(features))
        self.bias = nn.Parameter(0.1 * torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias
