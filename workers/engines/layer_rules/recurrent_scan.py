"""One layer of a recurrent module run again so that the gradient at its input projections can be read.

Holds ``RnnShape`` (what one call of an ``nn.RNNBase`` looks like, samples batch-first),
``DirWeights`` (one direction's weights, detached), ``LayerPass`` (one layer run again: its
output, final states, and the tensors whose gradients give the parameter gradients),
``native_layer`` and ``unrolled_layer`` (the two ways to run a layer again) and
``previous_states`` (the state each step started from, read off a layer's output).

Every weight gradient of a recurrent layer is a sum over samples and steps of outer products
with the gradient at the gate pre-activations ``gi_t = W_ih x_t + b_ih``: ``dW_ih = sum dgi_t
x_t^T``; for LSTM and the plain RNN the hidden part ``gh_t = W_hh h_{t-1} + b_hh`` is added to
``gi_t`` so ``dgh_t = dgi_t`` (``dW_hh = sum dgi_t h_{t-1}^T``); for GRU the new gate reads
``r_t * gh_n``, so ``dgh_t = [dgi_r, dgi_z, dgi_n * r_t]``. So one ordinary backward that stops at
``gi`` (``[N, T, G]`` per layer and direction, a per-sample quantity) gives every class's sums as
batched products over its samples' steps; no per-class copy of the weights is needed.

``native_layer`` gets ``dgi`` from torch's own kernel (cuDNN on a GPU, ATen's loop on the CPU):
it feeds the precomputed ``gi`` to the layer as its input with an identity input weight and a
zero input bias (exact: ``1 * v + 0 * w`` sums are exact), so the gradient at that input is
``dgi``; the price is an input product ``G`` wide instead of ``in`` (free on a GPU, not on a CPU).
``unrolled_layer`` runs the cell recurrence step by step in Python, with autograd: the CPU default
(as fast as ATen's own CPU loop, without the wide input), and always for LSTM ``proj_size``, whose
``weight_hr`` gradient needs the gradient at each projected state, which the kernel keeps to
itself. Packed sequences are run by length: the native path packs ``gi`` with the call's lengths;
the unrolled one keeps the state of a sample past its length unchanged and its output zero, as
ATen does (``torch.where``, so those steps give exactly zero gate gradients).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import _VF
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_KERNELS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


@dataclass(frozen=True)
class RnnShape:
    """One call of a recurrent module, samples batch-first.

    ``lengths``: each sample's number of steps (int64 on the CPU) when a packed input has unequal
    lengths, else None; ``mask``: ``[N, T]``, True where a step is within its sample's length."""

    mode: str
    dirs: int
    hidden: int
    out: int
    bias: bool
    lengths: torch.Tensor | None
    mask: torch.Tensor | None

    @property
    def gates(self) -> int:
        return GATES[self.mode] * self.hidden


@dataclass(frozen=True)
class DirWeights:
    """One layer and direction's weights, detached, in the compute dtype (``b_*`` None without bias,
    ``w_hr`` None without projection)."""

    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None
    w_hr: torch.Tensor | None


@dataclass
class LayerPass:
    """One layer run again. ``out``: ``[N, T, dirs * out]`` (zero past a sample's length);
    ``h_n``/``c_n``: ``[dirs, N, ...]``; ``gi``: per direction ``[N, T, G]`` on the graph;
    ``proj_h``: per direction the projected states of each step (on the graph), ``proj_pre``: the
    unprojected ones ``[N, T, hidden]`` (both empty without projection)."""

    out: torch.Tensor
    h_n: torch.Tensor
    c_n: torch.Tensor | None
    gi: list[torch.Tensor]
    proj_h: list[list[torch.Tensor]]
    proj_pre: list[torch.Tensor]


def _input_gates(x: torch.Tensor, ws: DirWeights, graph: bool, with_b_hh: bool = False) -> torch.Tensor:
    """``gi = x W_ih^T + b_ih`` for every step at once (``+ b_hh`` too if asked: the same gradient
    where the hidden part is added to it); a leaf that requires grad when the graph starts here."""
    b = ws.b_ih + ws.b_hh if with_b_hh and ws.b_ih is not None and ws.b_hh is not None else ws.b_ih
    gi = F.linear(x, ws.w_ih, b)
    if graph and not gi.requires_grad:
        gi.requires_grad_()
    return gi


def native_layer(
    shape: RnnShape, x: torch.Tensor, weights: list[DirWeights], h0: torch.Tensor, c0: torch.Tensor | None, graph: bool
) -> LayerPass:
    """One layer (all its directions) by torch's own kernel, fed ``gi`` through an identity weight."""
    if weights[0].w_hr is not None:
        raise ValueError("the native path does not read the projection's gradient; use unrolled_layer")
    G, D = shape.gates, shape.dirs
    gi = [_input_gates(x, ws, graph) for ws in weights]
    fed = torch.cat(gi, dim=2) if D > 1 else gi[0]
    eye = torch.eye(G, dtype=fed.dtype, device=fed.device)
    flat: list[torch.Tensor] = []
    for d, ws in enumerate(weights):
        w_in = F.pad(eye, (d * G, (D - 1 - d) * G)) if D > 1 else eye
        flat += [w_in, ws.w_hh]
        if shape.bias:
            assert ws.b_hh is not None
            flat += [torch.zeros_like(ws.b_hh), ws.b_hh]
    hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = h0
    run: Callable[..., Any] = getattr(_VF, _KERNELS[shape.mode])
    with (
        warnings.catch_warnings(),
        torch.backends.cudnn.flags(
            enabled=torch.backends.cudnn.enabled,
            benchmark=torch.backends.cudnn.benchmark,
            deterministic=torch.backends.cudnn.deterministic,
            allow_tf32=False,  # cuDNN's TF32 would round the identity product (and the gates)
        ),
    ):
        # cuDNN copies weights that are not one flat buffer (these are made here), and says so
        warnings.filterwarnings("ignore", message=".*contiguous chunk of memory.*")
        # train=True: with no dropout the same values, and cuDNN keeps what a backward needs only
        # in train mode (an eval-mode RNN's backward raises on a GPU).
        if shape.lengths is None:
            if c0 is not None:
                hx = (h0, c0)
            res = run(fed, hx, flat, shape.bias, 1, 0.0, True, D > 1, True)
            out, h_n = res[0], res[1]
            c_n = res[2] if c0 is not None else None
        else:
            packed = pack_padded_sequence(fed, shape.lengths, batch_first=True, enforce_sorted=False)
            order, back = packed.sorted_indices, packed.unsorted_indices
            assert order is not None and back is not None
            hx = h0.index_select(1, order)
            if c0 is not None:
                hx = (hx, c0.index_select(1, order))
            res = run(packed.data, packed.batch_sizes, hx, flat, shape.bias, 1, 0.0, True, D > 1)
            seq = PackedSequence(res[0], packed.batch_sizes, order, back)
            out = pad_packed_sequence(seq, batch_first=True, total_length=x.shape[1])[0]
            h_n = res[1].index_select(1, back)
            c_n = res[2].index_select(1, back) if c0 is not None else None
    return LayerPass(out, h_n, c_n, gi, [], [])


def _cell(
    mode: str, g_in: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, ws: DirWeights
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One step of the cell as ATen writes it: (new state, new cell state, unprojected state).
    ``g_in`` holds ``b_hh`` too, except for GRU."""
    if mode == "LSTM":
        assert c is not None
        i, f, g, o = torch.addmm(g_in, h, ws.w_hh.t()).chunk(4, 1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        pre = torch.sigmoid(o) * torch.tanh(c_new)
        if ws.w_hr is None:
            return pre, c_new, None
        return F.linear(pre, ws.w_hr), c_new, pre
    if mode == "GRU":
        i_r, i_z, i_n = g_in.chunk(3, 1)
        h_r, h_z, h_n = F.linear(h, ws.w_hh, ws.b_hh).chunk(3, 1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)  # b_hh's new-gate part is inside the reset gate
        return (h - n) * z + n, None, None
    act = torch.tanh if mode == "RNN_TANH" else torch.relu
    return act(torch.addmm(g_in, h, ws.w_hh.t())), None, None


def unrolled_layer(
    shape: RnnShape, x: torch.Tensor, weights: list[DirWeights], h0: torch.Tensor, c0: torch.Tensor | None, graph: bool
) -> LayerPass:
    """One layer (all its directions) step by step; past a sample's length its state is kept and
    its output is zero."""
    T = x.shape[1]
    outs, h_last, c_last, gis, proj_h, proj_pre = [], [], [], [], [], []
    for d, ws in enumerate(weights):
        gi = _input_gates(x, ws, graph, with_b_hh=shape.mode != "GRU")
        steps = gi.unbind(1)
        h, c = h0[d], (c0[d] if c0 is not None else None)
        out: list[torch.Tensor] = [h] * T
        cands: list[torch.Tensor] = [h] * T
        pres: list[torch.Tensor] = [h] * T
        for t in range(T - 1, -1, -1) if d == 1 else range(T):
            h_new, c_new, pre = _cell(shape.mode, steps[t], h, c, ws)
            if ws.w_hr is not None:
                assert pre is not None
                cands[t], pres[t] = h_new, pre.detach()
            if shape.mask is None:
                out[t], h, c = h_new, h_new, c_new
            else:
                live = shape.mask[:, t, None]
                out[t] = torch.where(live, h_new, torch.zeros_like(h_new))
                h = torch.where(live, h_new, h)
                c = torch.where(live, c_new, c) if c is not None and c_new is not None else None
        outs.append(torch.stack(out, dim=1))
        h_last.append(h)
        c_last.append(c)
        gis.append(gi)
        if ws.w_hr is not None:
            proj_h.append(cands)
            proj_pre.append(torch.stack(pres, dim=1))
    c_n = torch.stack(c_last) if c0 is not None else None  # type: ignore[arg-type]
    return LayerPass(torch.cat(outs, dim=2), torch.stack(h_last), c_n, gis, proj_h, proj_pre)


def previous_states(out: torch.Tensor, h0: torch.Tensor, lengths: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    """``[N, T, out]``: the state each step of one direction started from, given that direction's
    output ``out`` (its state after each step) and initial state ``h0`` ``[N, out]``. Entries past
    a sample's length are arbitrary (finite): their gate gradients are zero."""
    first = h0.unsqueeze(1)
    if not reverse:
        return torch.cat([first, out[:, :-1]], dim=1)
    prev = torch.cat([out[:, 1:], first], dim=1)
    if lengths is not None:
        rows = torch.arange(out.shape[0], device=out.device)
        prev[rows, lengths.to(out.device) - 1] = h0
    return prev
