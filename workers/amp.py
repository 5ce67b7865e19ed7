"""Mixed precision: autocast, fp16 loss scaling, and recomputing only the rows that overflow.

Holds:
- ``PrecisionPolicy``: fp32 / fp16 / bf16, the autocast context for a device, the float32
  arithmetic of a computation (``float32_arithmetic``: TF32 off on CUDA under fp32), and the fp16
  loss-scale schedule (start at ``init_scale``, halve per retry, give up below ``min_scale``).
- ``rows_with_rescale``: runs a row computation at the current per-row scales, checks every
  row with ``isfinite``, and recomputes only the rows that overflowed at half their scale.

Why per row: rows are independent VJPs, so an overflow in one class says nothing about the
others; recomputing only that row keeps the cost of a rare overflow to one row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from classgrad.config.compute import (
    DEFAULT_DTYPE,
    DEFAULT_INIT_SCALE,
    DEFAULT_MIN_SCALE,
    PRECISION_DTYPES,
    scales_in_order,
)
from classgrad.errors import InputError, NonFiniteError, RowOverflowError

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """How the forward pass runs and how fp16 gradients are scaled (the defaults and checks of the
    job file's ``precision`` section, ``classgrad.config.compute``)."""

    dtype: str = DEFAULT_DTYPE
    """fp32, fp16 (autocast + loss scaling) or bf16 (autocast, no scaling)."""
    init_scale: float = DEFAULT_INIT_SCALE
    """fp16: first loss scale S; rows are divided by S after the backward."""
    min_scale: float = DEFAULT_MIN_SCALE
    """fp16: a row still non-finite below this scale is an error naming its class."""

    def __post_init__(self) -> None:
        if self.dtype not in PRECISION_DTYPES:
            raise InputError(f"precision.dtype must be fp32, fp16 or bf16, got {self.dtype!r}")
        if not scales_in_order(self.init_scale, self.min_scale):
            raise InputError(f"precision.min_scale must be in (0, init_scale={self.init_scale}], got {self.min_scale}")

    @property
    def uses_scaling(self) -> bool:
        return self.dtype == "fp16"

    @property
    def first_scale(self) -> float:
        return self.init_scale if self.uses_scaling else 1.0

    def autocast(self, device: torch.device) -> AbstractContextManager:
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[self.dtype])

    @contextlib.contextmanager
    def float32_arithmetic(self, device: torch.device) -> Iterator[None]:
        """fp32 means float32 on CUDA too: TF32 off for cuDNN's convolutions and RNNs and for
        matmuls while the engine computes, whatever torch's settings (cuDNN's default is on:
        convolutions rounded to 10 bits, rows about 1e-3 off, and the hook path's rows no longer
        equal the plain path's to its check's 1e-4). Put back afterwards, as they were. bf16 and
        fp16 leave them alone (their products are already rounded further); the CPU has no TF32."""
        if self.dtype != "fp32" or device.type != "cuda":
            yield
            return
        with _tf32_off():
            yield


@contextlib.contextmanager
def _tf32_off() -> Iterator[None]:
    """TF32 off for matmuls and cuDNN, its settings put back after. Through torch's per-backend
    ``fp32_precision`` settings where this torch has them (2.9 on): reading the older
    ``allow_tf32`` flags raises once a user has set the newer ones, and setting them would lose a
    ``set_float32_matmul_precision("medium")``."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv") and hasattr(cudnn, "rnn"):
        settings = [matmul, cudnn.conv, cudnn.rnn]
        before = [str(s.fp32_precision) for s in settings]
        for setting in settings:
            setting.fp32_precision = "ieee"
        try:
            yield
        finally:
            for setting, value in zip(settings, before):
                setting.fp32_precision = value
        return
    flags = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = flags


RowFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rows_with_rescale(
    compute: RowFn,
    num_rows: int,
    policy: PrecisionPolicy,
    class_ids: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute rows, recomputing overflowed ones at half their loss scale until finite.

    ``compute(which, scales)`` returns the rows ``which`` (int64 positions in ``0..num_rows``),
    computed with loss scale ``scales[k]`` for row ``which[k]`` and already divided by it.
    Returns ``(rows, scales, recomputed)``: the final scale of each row and whether it needed
    more than one attempt. Without fp16 a non-finite row is an error naming its class.
    """
    which = torch.arange(num_rows, device=device)
    scales = torch.full((num_rows,), policy.first_scale, dtype=torch.float32, device=device)
    rows = compute(which, scales)
    recomputed = torch.zeros(num_rows, dtype=torch.bool, device=device)
    bad = ~torch.isfinite(rows).all(dim=1)
    while bool(bad.any()):
        if not policy.uses_scaling:
            c = int(class_ids[int(bad.nonzero()[0, 0].item())])
            raise NonFiniteError(f"non-finite gradient for class {c} in {policy.dtype}")
        scales = torch.where(bad, scales / 2, scales)
        if bool((scales[bad] < policy.min_scale).any()):
            stuck = class_ids[bad.cpu()].tolist()
            raise RowOverflowError(
                f"fp16 gradient rows of class(es) {stuck[:10]} stay non-finite down to loss scale "
                f"{policy.min_scale}; use precision.dtype=bf16 or fp32"
            )
        recomputed |= bad
        idx = bad.nonzero().squeeze(1)
        rows[idx] = compute(idx, scales[idx])
        bad = torch.zeros_like(bad)
        bad[idx] = ~torch.isfinite(rows[idx]).all(dim=1)
    return rows, scales, recomputed
