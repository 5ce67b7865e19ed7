"""The layer rules for ``nn.LayerNorm``, ``nn.GroupNorm`` and ``nn.RMSNorm``: per-class sums of
``g * x_hat`` (weight) and ``g`` (bias) over each class's samples and positions.

Holds ``layer_norm_sums``, ``group_norm_sums`` and ``rms_norm_sums`` (the registered rules),
``normalised`` helpers that recompute ``x_hat`` from the captured input, and ``per_class_sum``.

Each layer's output is ``weight * x_hat + bias`` with ``x_hat`` a function of the sample's own
input, so a class's weight gradient is the sum of ``g * x_hat`` over its samples (and over every
position the weight is broadcast along), its bias gradient the same sum of ``g``. ``x_hat`` is
recomputed by torch's own kernels without the affine part (``F.layer_norm``/``F.group_norm``
with no weight or bias), in float32 (float64 for a float64 model) from the captured input; RMSNorm with
``eps=None`` uses the machine epsilon of the float type torch computes in (float32 for half
inputs, which torch upcasts). Under autocast torch runs layer_norm and group_norm in float32
(and RMSNorm upcasts half inputs itself), so float32 ``x_hat`` is what the forward used, up to
the rounding of RMSNorm's half output, well inside the low-precision tolerances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers.engines.layer_rules.registry import register_rule
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows


def _work_dtype(seen: LayerCapture) -> torch.dtype:
    """float32 for half inputs (what torch's norm kernels compute in), else the rows' dtype."""
    return torch.promote_types(seen.grid.dtype, torch.float32)


def per_class_sum(seen: LayerCapture, t: torch.Tensor, channels: tuple[int, ...], channel_dim: int) -> torch.Tensor:
    """``t`` ``[total, ...]`` summed over everything but its ``channels`` dimensions (starting at
    ``channel_dim``) and over each class's samples: ``[k, *channels]``."""
    total, n = t.shape[0], len(channels)
    if channel_dim == 1:  # [total, *channels, positions...]
        per_sample = t.reshape(total, *channels, -1).sum(dim=-1)
    else:  # [total, positions..., *channels]
        per_sample = t.reshape(total, -1, *channels).sum(dim=1)
    assert per_sample.dim() == n + 1
    return seen.grid.class_sums(per_sample)


def _write(out: LayerRows, gw: torch.Tensor | None, gb: torch.Tensor | None) -> None:
    out.bound_by_values(gw, gb)  # their peaks, read with the run's: finite only if every entry is
    if gw is not None:
        out.put("weight", gw)
    if gb is not None:
        out.put("bias", gb)


def layer_norm_normalised(x: torch.Tensor, module: nn.LayerNorm, dtype: torch.dtype) -> torch.Tensor:
    # torch's own kernel without the affine part: the forward's x_hat, in one fused pass.
    return F.layer_norm(x.to(dtype), tuple(module.normalized_shape), None, None, module.eps)


@register_rule(nn.LayerNorm)
def layer_norm_sums(module: nn.LayerNorm, seen: LayerCapture, out: LayerRows) -> None:
    shape, dtype = tuple(module.normalized_shape), _work_dtype(seen)
    g = seen.grads.to(dtype)
    gb = per_class_sum(seen, g, shape, -1) if out.wants("bias") else None
    gw = None
    if out.wants("weight"):
        gw = per_class_sum(seen, g * layer_norm_normalised(seen.inputs, module, dtype), shape, -1)
    _write(out, gw, gb)


def group_norm_normalised(x: torch.Tensor, module: nn.GroupNorm, dtype: torch.dtype) -> torch.Tensor:
    return F.group_norm(x.to(dtype), module.num_groups, None, None, module.eps)


@register_rule(nn.GroupNorm)
def group_norm_sums(module: nn.GroupNorm, seen: LayerCapture, out: LayerRows) -> None:
    channels, dtype = (module.num_channels,), _work_dtype(seen)
    g = seen.grads.to(dtype)
    gb = per_class_sum(seen, g, channels, 1) if out.wants("bias") else None
    gw = None
    if out.wants("weight"):
        gw = per_class_sum(seen, g * group_norm_normalised(seen.inputs, module, dtype), channels, 1)
    _write(out, gw, gb)


def rms_norm_normalised(x: torch.Tensor, module: nn.RMSNorm, dtype: torch.dtype) -> torch.Tensor:
    # torch's default eps: the machine epsilon of the type it computes in (half inputs: float32).
    opmath = torch.promote_types(x.dtype, torch.float32)
    eps = module.eps if module.eps is not None else torch.finfo(opmath).eps
    dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
    x = x.to(dtype)
    return x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)


@register_rule(nn.RMSNorm, kinds=("weight",))
def rms_norm_sums(module: nn.RMSNorm, seen: LayerCapture, out: LayerRows) -> None:
    if not out.wants("weight"):
        return
    shape, dtype = tuple(module.normalized_shape), _work_dtype(seen)
    g = seen.grads.to(dtype)
    _write(out, per_class_sum(seen, g * rms_norm_normalised(seen.inputs, module, dtype), shape, -1), None)
