"""The layer rule for eval-mode ``nn.BatchNorm1d/2d/3d``: per-class sums of ``g`` and ``g * x_hat``.

Holds ``batchnorm_sums``, registered for the three types, and ``running_statistics`` (when it
applies). In eval mode the output is ``weight * x_hat + bias`` with ``x_hat`` normalised by the
running statistics, so a class's bias gradient is the sum of ``g`` over its samples and
positions, and its weight gradient the same sum of ``g * x_hat``. (In train mode batch
statistics couple the samples; the partitioned engine refuses such models anyway.)
"""

from __future__ import annotations

import torch
from torch import nn

from classgrad.workers.engines.layer_rules.registry import register_rule
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows


def running_statistics(module: nn.modules.batchnorm._BatchNorm) -> str | None:
    if module.training or module.running_var is None:
        return "batch statistics (train mode, or no running statistics) couple the samples"
    return None


@register_rule(nn.BatchNorm3d, applies=running_statistics)
@register_rule(nn.BatchNorm1d, applies=running_statistics)
@register_rule(nn.BatchNorm2d, applies=running_statistics)
def batchnorm_sums(module: nn.modules.batchnorm._BatchNorm, seen: LayerCapture, out: LayerRows) -> None:
    G = seen.grads.to(seen.grid.dtype)  # [total, C, ...]: per-sample sums over positions, then by class
    reduce = list(range(2, G.dim()))
    gb = seen.grid.class_sums(G.sum(dim=reduce) if reduce else G) if out.wants("bias") else None
    gw = None
    if out.wants("weight"):
        A = seen.inputs.to(G.dtype)
        assert module.running_mean is not None and module.running_var is not None  # running_statistics
        shape = (1, G.shape[1]) + (1,) * (G.dim() - 2)
        mean = module.running_mean.to(G.dtype).view(shape)
        invstd = torch.rsqrt(module.running_var.to(G.dtype) + module.eps).view(shape)
        prod = (A - mean).mul_(invstd).mul_(G)  # G * x_hat, one temporary instead of three
        gw = seen.grid.class_sums(prod.sum(dim=reduce) if reduce else prod)
    out.bound_by_values(gw, gb)  # their peaks, read with the run's: finite only if every entry is
    if gw is not None:
        out.put("weight", gw)
    if gb is not None:
        out.put("bias", gb)
