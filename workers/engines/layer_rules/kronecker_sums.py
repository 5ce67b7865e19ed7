"""Per-class sums of projected outer products: the Kronecker projection inside the backward.

Holds ``projected_outer_sums``, which ``outer.class_outer_sums`` calls for a layer whose rows are
projected (``LayerRows.projection``, a ``classgrad.workers.kronecker.KroneckerUnit``). Class i's
part of the row is ``F_a^T [dW_i | db_i] F_b = sum_t (F_a^T g_t)(F_b^T [x_t; 1])^T``: both token
factors are projected first (``[T, a] @ [a, k_out]`` and ``[T, b] @ [b, k_in]``), then one batched
product ``[k_out, T] @ [T, k_in]`` per class, so the layer's full per-class gradient never exists.
The bias is the constant-1 input feature: its row of ``F_b`` is added to every projected input
token (padding tokens have ``g = 0`` and add nothing). On its first call it also notes how many tokens
of a sample get a gradient (``unit.positions``, the most over the run's samples; one means the
per-class gradient has rank at most the class's sample count: a head, a pooler, or a last block
whose output is read at one token only).

A Conv2d's input side applied to every patch is a convolution with ``F_b`` as its kernel
(``[k_in, cin, kh, kw]``), so patches are never unfolded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.engines.layer_rules.rule_io import LayerRows, peak


def _conv_projected_inputs(factors: Any, fb: torch.Tensor) -> torch.Tensor:
    """``[k, m * ho * wo, k_in]``: every patch's projection, by one convolution."""
    module, A = factors.module, factors.A
    assert not isinstance(module.padding, str)  # zero_padding: the rule takes numeric padding only
    k, m = A.shape[:2]
    b = module.weight[0].numel()
    kernel = fb[:b].t().reshape(fb.shape[1], *module.weight.shape[1:])
    out = F.conv2d(A.reshape(k * m, *A.shape[2:]), kernel, None, module.stride, module.padding, module.dilation)
    return out.reshape(k, m, fb.shape[1], -1).permute(0, 1, 3, 2).reshape(k, -1, fb.shape[1])


def projected_outer_sums(factors: Any, out: LayerRows, unit: Any) -> None:
    """Class ``i``'s projected ``[dW_i | db_i]`` (``unit.width`` columns) into ``out``'s weight columns."""
    conv = isinstance(getattr(factors, "module", None), nn.Conv2d)
    ragged = factors.ragged() if out.run.rows.device.type in rule_io.CPU_ROUTE_DEVICES and not conv else None
    if ragged is not None:
        _ragged_projected_sums(ragged, out, unit)
        return
    G = factors.grad_tokens()  # [k, T, a] (one block: units are never grouped layers)
    if unit.positions is None:  # once: the tokens per sample with a gradient (1: low rank)
        seen = getattr(factors, "seen", None)  # Linear: samples per class in this run's grid
        width = seen.grid.width if seen is not None else factors.G.shape[1]
        live = (G != 0).any(dim=-1).reshape(G.shape[0], width, -1)  # [k, samples, positions]
        unit.positions = int(live.sum(dim=-1).max())
    fa, fb = unit.factors(G.device, G.dtype)
    gp = torch.matmul(G, fa)  # [k, T, k_out]
    # conv.ConvFactors (not imported: conv imports outer, which imports this module)
    if conv:
        ap = _conv_projected_inputs(factors, fb)
    else:
        A = factors.input_tokens()
        ap = torch.matmul(A, fb[: unit.b])  # [k, T, k_in]
    if unit.bias is not None:
        ap = ap + fb[unit.b]
    # Finite projected factors with |g'| * |x'| * terms far below the float range give finite rows.
    out.bound(peak(gp) * peak(ap).clamp(min=1) * gp.shape[1])
    target = out.fresh("weight")
    if target is not None:
        torch.bmm(gp.transpose(1, 2), ap, out=target.view(out.k, unit.k_out, unit.k_in))
    else:
        out.put("weight", torch.bmm(gp.transpose(1, 2), ap))


def _ragged_projected_sums(ragged: Any, out: LayerRows, unit: Any) -> None:
    """``projected_outer_sums`` on unpadded tokens (``outer.Ragged``): both factors projected in
    one product over the run's tokens, then one small product per class into its row."""
    G, A = ragged.grads, ragged.inputs
    if unit.positions is None:  # as in projected_outer_sums
        live = (G != 0).any(dim=-1).reshape(-1, ragged.per_sample)  # [samples, positions]
        unit.positions = int(live.sum(dim=-1).max())
    fa, fb = unit.factors(G.device, G.dtype)
    gp = G @ fa  # [tokens, k_out]
    ap = A @ fb[: unit.b]  # [tokens, k_in]
    if unit.bias is not None:
        ap = ap + fb[unit.b]
    out.bound(peak(gp) * peak(ap).clamp(min=1) * max(ragged.tokens))
    target = out.fresh("weight")
    shape = (out.k, unit.k_out, unit.k_in)
    sums = target.view(shape) if target is not None else gp.new_empty(shape)
    ragged.per_class_mm(gp, ap, sums)
    if target is None:
        out.put("weight", sums)
