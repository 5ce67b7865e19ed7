"""Per-class parameter gradients of a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), exact,
for a run of classes at once, from the layer's captured call and the gradient at its outputs.

Holds ``recurrent_class_grads`` (the rule), ``recurrent_refusal`` (why a layer is outside it,
or None), ``RECURRENT_TYPES`` and ``recurrent_unit`` (registered as the hook path's unit
computer for ``nn.RNNBase``).

How: the layer is run again, layer by layer, so that one ordinary backward from the given output
gradients stops at each layer's input gate pre-activations ``gi = W_ih x + b_ih`` (``[N, T, G]``,
a per-sample, per-step quantity; see ``recurrent_scan``). Every parameter gradient is a sum over
a class's samples and steps of outer products of ``dgi`` (or the hidden-gate gradient derived
from it) with the layer input, the previous state, or, for ``weight_hr``, the unprojected state;
those sums are batched matrix products, one per group of classes of equal size. Cost: one
forward and one backward of the layer over the run's samples (step by step on the CPU; torch's
own kernel elsewhere, fed ``gi`` through an identity input weight), plus one product per weight
of the same flops as the layer's own weight gradient; no per-class work in Python.

Why not per-class weight copies (Opacus' DPLSTM style, ``[k, ...]`` leaves, one bmm per class per
step): that forward needs a Python step loop too, and its backward adds the per-class weight
gradient ``[k, G, H]`` once per step (``T`` passes over ``k`` weight copies), where this rule
forms each sum once, in one product of the same flops. Measured on this 2-core CPU (one thread,
LSTM, 2 layers, T=32, H=64, 200 classes on a width-4 grid): 0.52 s for the copies' forward and
backward alone, 0.12 to 0.19 s for this whole rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from classgrad.workers.engines.layer_rules.module_vjp import module_class_grads, register_unit_computer
from classgrad.workers.engines.layer_rules.recurrent_scan import (
    DirWeights,
    LayerPass,
    RnnShape,
    native_layer,
    previous_states,
    unrolled_layer,
)
from classgrad.workers.engines.layer_rules.rule_io import ClassGrid, TokenSums

RECURRENT_TYPES = (nn.LSTM, nn.GRU, nn.RNN)


def recurrent_refusal(module: nn.Module) -> str | None:
    """None when ``recurrent_class_grads`` is exact for this layer as configured, else why not."""
    if type(module) not in RECURRENT_TYPES:
        return f"{type(module).__name__} is not exactly nn.LSTM, nn.GRU or nn.RNN (its forward may differ)"
    assert isinstance(module, nn.RNNBase)
    if module.training and module.dropout > 0 and module.num_layers > 1:
        return "dropout between recurrent layers in train mode (rows would depend on the seed)"
    if module.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
        return f"unknown recurrent mode {module.mode!r}"
    return None


@dataclasses.dataclass
class _Call:
    """The captured call, batch-first: ``x`` ``[N, T, in]`` (zero past a sample's length), initial
    states ``[layers * dirs, N, ...]``, and the output gradients in the same layout (None: none)."""

    shape: RnnShape
    x: torch.Tensor
    h0: torch.Tensor
    c0: torch.Tensor | None
    g_out: torch.Tensor | None
    g_h: torch.Tensor | None
    g_c: torch.Tensor | None


def _compute_dtype(module: nn.RNNBase) -> torch.dtype:
    """The layer's dtype, float32 for half precision (the recurrence and its sums are run in it)."""
    dtype = module.weight_ih_l0.dtype
    assert isinstance(dtype, torch.dtype)
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _read_call(module: nn.RNNBase, args: tuple, kwargs: dict, grad_outputs: tuple, dtype: torch.dtype) -> _Call:
    """The call and its output gradients, batch-first, padded, in ``dtype`` (see ``_Call``)."""
    params: dict[str, Any] = dict(zip(("input", "hx"), args))
    params.update(kwargs)
    inp, hx = params["input"], params.get("hx")
    D = 2 if module.bidirectional else 1
    H = module.hidden_size
    P = module.proj_size or H
    lstm = module.mode == "LSTM"
    # the gradients: (output, hidden) with hidden = h_n or (h_n, c_n); LSTM's may come flat
    g_out, g_hidden, *rest = tuple(grad_outputs) + (None,) * 2
    g_h, g_c = (g_hidden if isinstance(g_hidden, (tuple, list)) else (g_hidden, rest[0])) if lstm else (g_hidden, None)
    if isinstance(g_out, PackedSequence):
        g_out = g_out.data
    lengths = None
    if isinstance(inp, PackedSequence):
        x, lengths = pad_packed_sequence(inp, batch_first=True)
        if g_out is not None:
            seq = PackedSequence(g_out, inp.batch_sizes, inp.sorted_indices, inp.unsorted_indices)
            g_out = pad_packed_sequence(seq, batch_first=True)[0]
    elif inp.dim() == 2:  # unbatched: one sample, states without a batch dimension
        x = inp.unsqueeze(0)
        g_out = g_out.unsqueeze(0) if g_out is not None else None
        g_h = g_h.unsqueeze(1) if g_h is not None else None
        g_c = g_c.unsqueeze(1) if g_c is not None else None
        if hx is not None:
            hx = tuple(s.unsqueeze(1) for s in hx) if lstm else hx.unsqueeze(1)
    else:
        x = inp if module.batch_first else inp.transpose(0, 1)
        if g_out is not None and not module.batch_first:
            g_out = g_out.transpose(0, 1)
    N, T = x.shape[0], x.shape[1]
    if lengths is not None and bool((lengths == T).all()):
        lengths = None
    L = module.num_layers * D
    device = x.device
    if hx is None:
        h0 = torch.zeros(L, N, P, dtype=dtype, device=device)
        c0 = torch.zeros(L, N, H, dtype=dtype, device=device) if lstm else None
    else:
        h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
    mask = None
    if lengths is not None:
        mask = torch.arange(T, device=device)[None, :] < lengths.to(device)[:, None]
    shape = RnnShape(module.mode, D, H, P, module.bias, lengths, mask)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().to(dtype)

    x0, h00 = cast(x), cast(h0)
    assert x0 is not None and h00 is not None
    return _Call(shape, x0, h00, cast(c0), cast(g_out), cast(g_h), cast(g_c))


def _weights(module: nn.RNNBase, layer: int, d: int, dtype: torch.dtype) -> DirWeights:
    """Layer ``layer``'s weights in direction ``d`` (1: reverse), detached, in ``dtype``."""
    sfx = f"_l{layer}" + ("_reverse" if d else "")

    def get(name: str) -> torch.Tensor | None:
        p = getattr(module, name + sfx, None)
        return None if p is None else p.detach().to(dtype)

    w_ih, w_hh = get("weight_ih"), get("weight_hh")
    assert w_ih is not None and w_hh is not None
    has_bias = module.bias
    return DirWeights(
        w_ih,
        w_hh,
        get("bias_ih") if has_bias else None,
        get("bias_hh") if has_bias else None,
        get("weight_hr") if module.proj_size else None,
    )


def _run_layers(
    module: nn.RNNBase, call: _Call, first_graph_layer: int, method: str
) -> tuple[list[torch.Tensor], list[LayerPass]]:
    """Runs every layer again (layers below ``first_graph_layer`` without a graph); returns each
    layer's input and pass."""
    D, shape = call.shape.dirs, call.shape
    x = call.x
    inputs, passes = [], []
    for layer in range(module.num_layers):
        ws = [_weights(module, layer, d, x.dtype) for d in range(D)]
        h0 = call.h0[layer * D : (layer + 1) * D]
        c0 = call.c0[layer * D : (layer + 1) * D] if call.c0 is not None else None
        graph = layer >= first_graph_layer
        unrolled = module.proj_size > 0 or method == "unrolled" or (method == "auto" and x.device.type == "cpu")
        with torch.set_grad_enabled(graph):
            run = unrolled_layer if unrolled else native_layer
            lp = run(shape, x, ws, h0, c0, graph)
        inputs.append(x)
        passes.append(lp)
        x = lp.out
    return inputs, passes


def recurrent_class_grads(
    module: nn.RNNBase,
    args: tuple,
    kwargs: dict,
    grad_outputs: tuple,
    grid: ClassGrid,
    kinds: Sequence[str],
    *,
    method: str = "auto",
) -> dict[str, torch.Tensor]:
    """Per-class gradients ``{name: [k, *param.shape]}`` of the recurrent layer's parameters
    ``kinds`` (``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``, ...), in ``grid.dtype``.

    Class i's entry is the gradient of ``sum <grad_output, output>`` over its samples (``grid``
    places the call's samples, class after class). ``args``/``kwargs``: the module's call (input
    tensor or ``PackedSequence``, optional ``hx``); ``grad_outputs``: gradients with the
    structure of its output (``(output, h_n)`` or ``(output, (h_n, c_n))``, None where none; the
    output's may be a ``PackedSequence``'s data). ``method``: ``"native"`` runs the layer again by
    torch's kernel (cuDNN on a GPU), ``"unrolled"`` step by step in Python (always so with
    ``proj_size``), ``"auto"`` the unrolled cells on the CPU (ATen's CPU loop is no faster, and
    its input product is ``G`` wide instead of ``in``) and the kernel elsewhere."""
    why = recurrent_refusal(module)
    if why is not None:
        raise ValueError(f"recurrent_class_grads: {why}")
    names = set(module._flat_weights_names)
    unknown = [k for k in kinds if k not in names]
    if unknown:
        raise KeyError(f"{type(module).__name__} has no parameters {unknown}")
    dtype = _compute_dtype(module)
    call = _read_call(module, args, kwargs, grad_outputs, dtype)
    placed = grid.k * grid.width if grid.spots is None else grid.spots.numel()
    if call.x.shape[0] != placed:
        raise ValueError(f"recurrent_class_grads: the call has {call.x.shape[0]} samples, the grid places {placed}")
    wanted: dict[tuple[int, int], list[str]] = {}
    for name in kinds:
        layer = int(name.split("_l")[1].split("_")[0])
        wanted.setdefault((layer, 1 if name.endswith("_reverse") else 0), []).append(name)
    result: dict[str, torch.Tensor | None] = {name: None for name in kinds}
    sums_grid = dataclasses.replace(grid, dtype=dtype)
    if wanted and call.x.shape[0] > 0:
        _fill(module, call, wanted, method, sums_grid, result)
    params: dict[str, torch.Tensor] = {name: getattr(module, name) for name in kinds}
    return {
        name: (
            value.to(grid.dtype)
            if value is not None
            else torch.zeros(grid.k, *params[name].shape, dtype=grid.dtype, device=params[name].device)
        )
        for name, value in result.items()
    }


def _fill(
    module: nn.RNNBase,
    call: _Call,
    wanted: dict[tuple[int, int], list[str]],
    method: str,
    grid: ClassGrid,
    result: dict[str, torch.Tensor | None],
) -> None:
    """Runs the layers again, backward once to every wanted ``gi``, and forms the class sums."""
    shape, D = call.shape, call.shape.dirs
    inputs, passes = _run_layers(module, call, min(layer for layer, _ in wanted), method)
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    last = passes[-1]
    if call.g_out is not None and last.out.requires_grad:
        outs.append(last.out)
        grads.append(call.g_out)
    for layer, lp in enumerate(passes):
        for state, g in ((lp.h_n, call.g_h), (lp.c_n, call.g_c)):
            if g is not None and state is not None and state.requires_grad:
                outs.append(state)
                grads.append(g[layer * D : (layer + 1) * D])
    if not outs:
        return
    keys = sorted(wanted)
    targets: list[torch.Tensor] = [passes[layer].gi[d] for layer, d in keys]
    proj = [(layer, d) for layer, d in keys if any(n.startswith("weight_hr") for n in wanted[(layer, d)])]
    for layer, d in proj:
        targets += passes[layer].proj_h[d]
    found = torch.autograd.grad(outs, targets, grads, allow_unused=True)
    sums = TokenSums(grid, call.x.device)
    for (layer, d), dgi in zip(keys, found[: len(keys)]):
        if dgi is not None:  # else no path from this direction to the given gradients: zero
            names = {name.split("_l")[0]: name for name in wanted[(layer, d)]}
            _direction_sums(module, call, inputs[layer], passes[layer], layer, d, dgi, sums, names, result)
    at = len(keys)
    for layer, d in proj:
        T = call.x.shape[1]
        dh = found[at : at + T]
        at += T
        if all(g is None for g in dh):
            continue
        ref = passes[layer].proj_pre[d]
        zero = ref.new_zeros(ref.shape[0], shape.out)
        dh_full = torch.stack([g if g is not None else zero for g in dh], dim=1)
        result[f"weight_hr_l{layer}" + ("_reverse" if d else "")] = sums.outer(dh_full, ref)


def _direction_sums(
    module: nn.RNNBase,
    call: _Call,
    x: torch.Tensor,
    lp: LayerPass,
    layer: int,
    d: int,
    dgi: torch.Tensor,
    sums: TokenSums,
    names: dict[str, str],
    result: dict[str, torch.Tensor | None],
) -> None:
    """The class sums of one layer and direction's ``weight_ih``/``weight_hh``/biases (``names``:
    kind -> parameter name) from the gradient ``dgi`` at its input gates."""
    shape, ws = call.shape, _weights(module, layer, d, call.x.dtype)
    P, H = shape.out, shape.hidden
    out_d = lp.out.detach()[..., d * P : (d + 1) * P]
    h_prev = previous_states(out_d, call.h0[layer * shape.dirs + d], shape.lengths, reverse=d == 1)
    dgh = dgi  # LSTM and RNN add the hidden part to the input part: the same gradient
    if shape.mode == "GRU":  # the new gate's hidden part is scaled by the reset gate
        b = ws.b_hh[:H] if ws.b_hh is not None else None
        r = torch.sigmoid(lp.gi[d].detach()[..., :H] + torch.nn.functional.linear(h_prev, ws.w_hh[:H], b))
        dgh = torch.cat([dgi[..., : 2 * H], dgi[..., 2 * H :] * r], dim=2)
    # weight_ih, and weight_hh where its gate gradient is dgi, in one product
    right = [(k, f) for k, f in (("weight_ih", x.detach()), ("weight_hh", h_prev)) if k in names]
    if "weight_hh" in names and dgh is not dgi:
        result[names["weight_hh"]] = sums.outer(dgh, h_prev)
        right = right[:1] if right[0][0] == "weight_ih" else []
    if right:
        both = sums.outer(dgi, torch.cat([f for _, f in right], dim=2) if len(right) > 1 else right[0][1])
        for (k, _), part in zip(right, both.split([f.shape[2] for _, f in right], dim=2)):
            result[names[k]] = part
    if "bias_ih" in names:
        result[names["bias_ih"]] = sums.total(dgi)
    if "bias_hh" in names:
        result[names["bias_hh"]] = sums.total(dgh)


def rerun(
    module: nn.RNNBase, args: tuple, kwargs: dict, *, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The layer's call run again as the rule runs it: ``(output, h_n, c_n)``, output batch-first
    and padded with zeros past each sample's length (a check that the rule's forward is torch's)."""
    dtype = _compute_dtype(module)
    call = _read_call(module, args, kwargs, (None, None), dtype)
    with torch.no_grad():
        _, passes = _run_layers(module, call, module.num_layers, method)
    c_n = [lp.c_n for lp in passes if lp.c_n is not None]
    return passes[-1].out, torch.cat([lp.h_n for lp in passes]), torch.cat(c_n) if c_n else None


@register_unit_computer(nn.RNNBase)
def recurrent_unit(
    module: nn.Module, args: tuple, kwargs: dict, grad_outputs: Any, grid: ClassGrid, kinds: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The hook path's unit computer for recurrent layers: class-batched where
    ``recurrent_refusal`` allows (exactly nn.LSTM/GRU/RNN), the generic module VJP otherwise."""
    if recurrent_refusal(module) is not None:
        return module_class_grads(module, args, kwargs, grad_outputs, grid, kinds)
    assert isinstance(module, nn.RNNBase)
    return recurrent_class_grads(module, args, kwargs, tuple(grad_outputs), grid, kinds)
