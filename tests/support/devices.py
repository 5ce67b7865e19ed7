"""The devices a test runs on: the CPU always, CUDA where there is one. A CUDA case is marked
``cuda`` (``pytest -m cuda`` selects it; ``benchmarks/gpu_proof.py``'s ``cuda_tests`` runs every
test file that imports this module that way on a lent GPU) and skipped without a CUDA device."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

F = TypeVar("F", bound=Callable[..., object])

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def needs_cuda(test: F) -> F:
    """A test that only means something on CUDA: marked ``cuda``, skipped without it."""
    return pytest.mark.cuda(_NO_CUDA(test))


# parametrize("device", DEVICES): the same test on the CPU and, marked and skipped as above, on CUDA.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, _NO_CUDA])]
