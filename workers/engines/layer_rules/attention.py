"""Per-class parameter gradients of ``nn.MultiheadAttention``, exact, for a run of classes at once,
from the layer's captured call and the gradient at its output.

Holds ``attention_class_grads`` (the rule), ``attention_refusal`` (why a layer or a call is
outside it, or None) and ``attention_unit`` (registered as the hook path's unit computer for
``nn.MultiheadAttention``; the generic module VJP where the rule refuses).

How: the layer is run again from its captured call, its q/k/v projections taken here (so that
their outputs are leaves of the graph) and the attention itself by torch's own
``F.multi_head_attention_forward`` with identity projections (so the masks, ``is_causal`` and the
heads are exactly the module's). One backward from the gradient at the attention's output before
``out_proj`` (the output gradient times ``W_o``) gives ``dq``, ``dk``, ``dv`` per sample and token.
Every parameter gradient is then a per-class sum over the class's samples and tokens of outer
products (``TokenSums``): ``in_proj_weight`` is ``[dq x_q; dk x_k; dv x_v]``, ``out_proj.weight``
the output gradient with the attention's output before ``out_proj``, the biases their sums. Cost:
one forward and backward of the attention over the run, plus products of the layer's own
weight-gradient flops, where the generic unit runs a VJP vmapped over the classes with a copy of
every parameter per sample.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from classgrad.workers.engines.layer_rules.module_vjp import module_class_grads, register_unit_computer
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid, TokenSums


def attention_refusal(module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any) -> str | None:
    """None when ``attention_class_grads`` is exact for this layer and call, else why not."""
    return _layer_refusal(module) or _call_refusal(_arguments(module, args, kwargs), _grads(grad_outputs))


def _layer_refusal(module: nn.Module) -> str | None:
    if type(module) is not nn.MultiheadAttention:
        return f"{type(module).__name__} is not exactly nn.MultiheadAttention (its forward may differ)"
    if module.bias_k is not None or module.add_zero_attn:
        return "add_bias_kv or add_zero_attn"
    if module.training and module.dropout > 0:
        return "dropout in train mode (rows would depend on the seed)"
    return None


def _call_refusal(call: dict[str, Any], grads: tuple) -> str | None:
    query = call["query"]
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or query.is_nested:
        return "an unbatched or nested query"
    if grads[0] is None or any(g is not None for g in grads[1:]):
        return "a gradient at the attention weights, or none at the output"
    return None


def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _grads(grad_outputs: Any) -> tuple:
    return tuple(grad_outputs) if isinstance(grad_outputs, (tuple, list)) else (grad_outputs,)


def attention_class_grads(
    module: nn.MultiheadAttention,
    args: tuple,
    kwargs: dict,
    grad_outputs: Any,
    grid: ClassGrid,
    kinds: Sequence[str],
) -> dict[str, torch.Tensor]:
    """Per-class gradients ``{name: [k, *param.shape]}`` of the parameters ``kinds``
    (``in_proj_weight``, ``out_proj.bias``, ...), in ``grid.dtype``: class i's entry is the
    gradient of ``sum <grad_output, output>`` over its samples (``grid`` places the call's
    samples, class after class). The caller checks ``attention_refusal`` first."""
    return _class_grads(module, _arguments(module, args, kwargs), _grads(grad_outputs)[0], grid, kinds)


def _class_grads(
    module: nn.MultiheadAttention, call: dict[str, Any], g_out: torch.Tensor, grid: ClassGrid, kinds: Sequence[str]
) -> dict[str, torch.Tensor]:
    """``attention_class_grads`` of a bound call (``_arguments``) and its output's gradient."""
    first = module.batch_first

    def seq_first(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.transpose(0, 1) if first else t

    xq, xk, xv = (seq_first(call[n]) for n in ("query", "key", "value"))  # [L, N, features]
    go = seq_first(g_out).to(xq.dtype)
    E = module.embed_dim
    if module.in_proj_weight is not None:
        weights = list(module.in_proj_weight.detach().chunk(3))
    else:
        weights = [w.detach() for w in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)]
    bias = module.in_proj_bias
    biases = list(bias.detach().chunk(3)) if bias is not None else [None, None, None]
    with torch.enable_grad():
        qkv = [F.linear(x, w, b).detach().requires_grad_() for x, w, b in zip((xq, xk, xv), weights, biases)]
        eye = torch.eye(E, dtype=qkv[0].dtype, device=qkv[0].device)
        attended, _ = F.multi_head_attention_forward(
            qkv[0], qkv[1], qkv[2], E, module.num_heads, None, None, None, None, False, 0.0, eye, None,
            training=False, key_padding_mask=call["key_padding_mask"], need_weights=False,
            attn_mask=call["attn_mask"], use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
            v_proj_weight=eye, is_causal=call["is_causal"],
        )  # fmt: skip
        d_attended = go @ module.out_proj.weight.detach().to(go.dtype)
        found = torch.autograd.grad(attended, qkv, d_attended, allow_unused=True)
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for t, g in zip(qkv, found))

    def batch_first(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).to(grid.dtype)

    sums = TokenSums(grid, xq.device)
    a, g = batch_first(attended.detach()), batch_first(go)
    inputs = [batch_first(x) for x in (xq, xk, xv)]
    grads = [batch_first(d) for d in (dq, dk, dv)]
    out: dict[str, torch.Tensor] = {}
    for name in kinds:
        if name == "in_proj_weight":
            same = call["query"] is call["key"] is call["value"]
            out[name] = (
                sums.outer(torch.cat(grads, dim=2), inputs[0])
                if same
                else torch.cat([sums.outer(d, x) for d, x in zip(grads, inputs)], dim=1)
            )
        elif name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            i = "qkv".index(name[0])
            out[name] = sums.outer(grads[i], inputs[i])
        elif name == "in_proj_bias":
            out[name] = torch.cat([sums.total(d) for d in grads], dim=1)
        elif name == "out_proj.weight":
            out[name] = sums.outer(g, a)
        elif name == "out_proj.bias":
            out[name] = sums.total(g)
        else:
            raise KeyError(f"nn.MultiheadAttention has no parameter {name!r}")
    return {name: value.to(grid.dtype) for name, value in out.items()}


@register_unit_computer(nn.MultiheadAttention)
def attention_unit(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The hook path's unit computer for attention: class-batched where ``attention_refusal``
    allows, the generic module VJP otherwise (the call bound once for the check and the rule)."""
    if _layer_refusal(module) is None:
        call, grads = _arguments(module, args, kwargs), _grads(grad_outputs)
        if _call_refusal(call, grads) is None:
            assert isinstance(module, nn.MultiheadAttention)
            return _class_grads(module, call, grads[0], grid, kinds)
    return module_class_grads(module, args, kwargs, grad_outputs, grid, kinds)
