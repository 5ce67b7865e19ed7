"""Per-class sums of projected outer products: the Kronecker projection inside the backward.

Holds ``projected_outer_sums``, which ``outer.class_outer_sums`` calls for a layer whose rows are
projected (``LayerRows.projection``, a ``classgrad.workers.projection.kronecker.KroneckerUnit``), and
``projected_embedding_sums``, which the embedding rule calls instead of forming the table.

Class i's part of the row is ``F_a^T [dW_i | db_i] F_b = sum_t (F_a^T g_t)(F_b^T [x_t; 1])^T``:
both token factors are projected first (``[T, a] @ [a, k_out]`` and ``[T, b] @ [b, k_in]``), then
one batched product ``[k_out, T] @ [T, k_in]`` per class, so the layer's full per-class gradient
never exists. The bias is the constant-1 input feature: its row of ``F_b`` is added to every
projected input token (padding tokens have ``g = 0`` and add nothing). For transformers'
``Conv1D`` the stored matrix is ``[in, out]``: its factors come with the input first
(``hf_conv1d``), so the bias's row is ``F_a``'s (``KroneckerUnit.input_first``), added to the
first projected factor, and the gradient is the second factor. On its first call it also notes
how many tokens of a sample get a gradient (``unit.positions``, the most over the run's samples;
one means the per-class gradient has rank at most the class's sample count: a head, a pooler, or
a last block whose output is read at one token only).

A convolution's (1, 2 or 3-d) input side applied to every patch is a convolution with ``F_b`` as its kernel
(``[k_in, cin, kh, kw]``), so patches are never unfolded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.engines.layer_rules.rule_io import LayerRows, Ragged, peak


def _conv_projected_inputs(factors: Any, fb: torch.Tensor) -> torch.Tensor:
    """``[k, m * positions, k_in]``: every patch's projection, by one convolution (1, 2 or 3-d)."""
    module, A = factors.module, factors.A
    assert not isinstance(module.padding, str)  # zero_padding: the rule takes numeric padding only
    k, m = A.shape[:2]
    b = module.weight[0].numel()
    kernel = fb[:b].t().reshape(fb.shape[1], *module.weight.shape[1:])
    conv = (F.conv1d, F.conv2d, F.conv3d)[A.dim() - 4]  # A: [k, m, cin, *spatial]
    out = conv(A.reshape(k * m, *A.shape[2:]), kernel, None, module.stride, module.padding, module.dilation)
    return out.reshape(k, m, fb.shape[1], -1).permute(0, 1, 3, 2).reshape(k, -1, fb.shape[1])


def _project_pair(
    G: torch.Tensor, A: torch.Tensor, unit: Any, fa: torch.Tensor, fb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both token factors projected (``[..., a] @ F_a``, ``[..., b] @ F_b``), the bias's row of its
    factor added on the input's side: the second factor's (Linear), or the first's when the stored
    matrix's first axis is the input (``unit.input_first``: Conv1D's ``[in, out]``)."""
    gp = G @ fa[: unit.a]
    ap = A @ fb[: unit.b]
    if unit.bias is not None and unit.input_first:
        gp = gp + fa[unit.a]
    elif unit.bias is not None:
        ap = ap + fb[unit.b]
    return gp, ap


def projected_outer_sums(factors: Any, out: LayerRows, unit: Any) -> None:
    """Class ``i``'s projected ``[dW_i | db_i]`` (``unit.width`` columns) into ``out``'s weight columns."""
    conv = isinstance(getattr(factors, "module", None), (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    ragged = factors.ragged() if rule_io.cpu_routes(out.run.rows.device) and not conv else None
    if ragged is not None:
        _ragged_projected_sums(ragged, out, unit)
        return
    G = factors.grad_tokens()  # [k, T, a] (one block: units are never grouped layers)
    A = None if conv else factors.input_tokens()
    if unit.positions is None:  # once: the tokens per sample with a gradient (1: low rank)
        seen = getattr(factors, "seen", None)  # Linear: samples per class in this run's grid
        width = seen.grid.width if seen is not None else factors.G.shape[1]
        g = A if unit.input_first else G  # the output gradient's side (Conv1D: the second)
        assert g is not None  # a Conv2d's first factor is its gradient
        live = (g != 0).any(dim=-1).reshape(g.shape[0], width, -1)  # [k, samples, positions]
        unit.positions = int(live.sum(dim=-1).max())
    fa, fb = unit.factors(G.device, G.dtype)
    # conv.ConvFactors (not imported: conv imports outer, which imports this module)
    if conv:
        gp = torch.matmul(G, fa)  # [k, T, k_out]
        ap = _conv_projected_inputs(factors, fb)
        if unit.bias is not None:
            ap = ap + fb[unit.b]
    else:
        assert A is not None
        gp, ap = _project_pair(G, A, unit, fa, fb)
    # Finite projected factors with |g'| * |x'| * terms far below the float range give finite rows.
    out.bound(peak(gp) * peak(ap).clamp(min=1) * gp.shape[1])
    target = out.fresh("weight")
    if target is not None:
        torch.bmm(gp.transpose(1, 2), ap, out=target.view(out.k, unit.k_out, unit.k_in))
    else:
        out.put("weight", torch.bmm(gp.transpose(1, 2), ap))


def _ragged_projected_sums(ragged: Any, out: LayerRows, unit: Any) -> None:
    """``projected_outer_sums`` on unpadded tokens (``rule_io.Ragged``): both factors projected in
    one product over the run's tokens, then one small product per class into its row."""
    G, A = ragged.grads, ragged.inputs
    if unit.positions is None:  # as in projected_outer_sums
        g = A if unit.input_first else G
        live = (g != 0).any(dim=-1).reshape(-1, ragged.per_sample)  # [samples, positions]
        unit.positions = int(live.sum(dim=-1).max())
    fa, fb = unit.factors(G.device, G.dtype)
    gp, ap = _project_pair(G, A, unit, fa, fb)  # [tokens, k_out], [tokens, k_in]
    out.bound(peak(gp) * peak(ap).clamp(min=1) * max(ragged.tokens))
    target = out.fresh("weight")
    shape = (out.k, unit.k_out, unit.k_in)
    sums = target.view(shape) if target is not None else gp.new_empty(shape)
    ragged.per_class_mm(gp, ap, sums)
    if target is None:
        out.put("weight", sums)


def projected_embedding_sums(module: nn.Embedding, seen: Any, out: LayerRows, unit: Any) -> None:
    """Class ``i``'s projected table gradient ``F_V^T dW_i F_H = sum_t F_V[id_t]^T (F_H^T g_t)``:
    the one-hot input projected is a row of ``F_V`` (a lookup), the gradient a ``[H, k_in]``
    product. Tokens of ``padding_idx`` add nothing (the exact rows leave that row zero)."""
    rule_io.sample_classes(seen)  # ids broadcast across the batch (not the run's samples): raises
    idx = seen.inputs.reshape(seen.total, -1)  # [samples, positions]
    grads = seen.grads.to(seen.grid.dtype).reshape(seen.total, idx.shape[1], -1)
    fa, fb = unit.factors(grads.device, grads.dtype)
    gp = fa[idx]  # [samples, positions, k_out]
    if module.padding_idx is not None:
        gp = gp * (idx != module.padding_idx).unsqueeze(-1).to(gp.dtype)
    ap = grads @ fb  # [samples, positions, k_in]
    if unit.positions is None:  # as in projected_outer_sums
        unit.positions = int((grads != 0).any(dim=-1).sum(dim=-1).max()) if seen.total else 0
    out.bound(peak(gp) * peak(ap).clamp(min=1) * (seen.grid.width * idx.shape[1]))
    target = out.fresh("weight")
    shape = (out.k, unit.k_out, unit.k_in)
    sums = target.view(shape) if target is not None else gp.new_empty(shape)
    grid = seen.grid
    if grid.spots is not None and rule_io.cpu_routes(grads.device):
        # Unpadded: one product per class on its own samples (they come class after class).
        positions = idx.shape[1]
        gp, ap = gp.reshape(-1, unit.k_out), ap.reshape(-1, unit.k_in)
        tokens = [n * positions for n in grid.sizes]
        Ragged(gp, ap, tokens, positions).per_class_mm(gp, ap, sums)
    else:  # the padded grid: one batched product
        gk = seen.by_class(gp).reshape(out.k, -1, unit.k_out)
        ak = seen.by_class(ap).reshape(out.k, -1, unit.k_in)
        torch.bmm(gk.transpose(1, 2), ak, out=sums)
    if target is None:
        out.put("weight", sums)
