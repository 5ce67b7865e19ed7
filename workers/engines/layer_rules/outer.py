"""Per-class sums of outer products: the one place that forms weight gradients of Linear-like layers.

Holds ``OuterFactors`` (how a layer describes its weight gradient as a sum of outer products over
tokens; ``rule_io.Ragged``: the same tokens unpadded) and ``class_outer_sums`` (forms the per-class sums
and bias sums and writes them).

For a layer whose output at token t is ``W x_t (+ b)`` (Linear: a token per sample and position;
Conv: a token per sample and output pixel, ``x_t`` its input patch), class i's gradients are
``dW_i = sum_t g_t x_t^T`` and ``db_i = sum_t g_t`` over its samples' tokens. On a GPU the sums
are one batched product over a ``[k, T, ...]`` grid (short classes padded with zero tokens); on
a CPU, when classes differ in size and samples have several tokens, one ``torch.mm`` per class on
its own slice of the unpadded tokens, written straight into its row (no padded copies, no
products of padding). Grouped layers give
one product per class and group (``blocks``). A projection inside the backward goes into
``class_outer_sums`` for every such layer at once: ``P_out dW_i P_in^T = sum_t (P_out g_t)(P_in
x_t)^T``, i.e. project both token factors first, then the same batched product
(``kronecker_sums.projected_outer_sums``, when ``out.projection`` is a Kronecker unit); a
TensorSketch unit's rows come from ``sketch_sums.sketched_outer_sums``: each structure registers
its sums (``registry.projected_sums``, by the unit's ``structure``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.engines.layer_rules.registry import projected_sums
from classgrad.workers.engines.layer_rules.rule_io import LayerRows, Ragged, peak


class OuterFactors(ABC):
    """A layer's per-class weight gradient as ``grad_tokens[b]^T @ input_tokens[b]`` for each of
    ``k * blocks`` products ``b`` (class-major, then block: its weight gradient, in memory order),
    and its bias gradient as ``grad_tokens[b].sum(0)``. Padding tokens are zero."""

    @abstractmethod
    def grad_tokens(self) -> torch.Tensor:
        """``[k * blocks, T, out]``: the gradient at the layer's output, per token."""

    @abstractmethod
    def input_tokens(self) -> torch.Tensor:
        """``[k * blocks, T, in]``: the input factor per token (Conv: the patch it sees)."""

    def grid_tokens(self) -> int:
        """``k * blocks * T`` of ``grad_tokens()``, for a route chosen before (or instead of)
        forming them: a convolution's exact kernel never needs its tokens. Override it from
        shapes: this default forms the tokens once more."""
        G = self.grad_tokens()
        return G.shape[0] * G.shape[1]

    def input_tokens_any_order(self) -> tuple[torch.Tensor, int | None]:
        """``input_tokens()`` with the features in whatever order is cheapest to form, and how
        they are ordered: None (the weight's), or ``cin`` (a convolution's kernel-offset-major
        order, ``cin`` channels innermost: ``SketchUnit.column_order``). For sums a sketch takes."""
        return self.input_tokens(), None

    def ragged(self, live: bool = False, one_token: bool = False) -> Ragged | None:
        """The same tokens with no padding (classes of unequal size, samples of several tokens),
        or None: only the grid; ``live``: without the tokens whose output gradient is all zero
        (``rule_io.live_tokens``), and then also for classes of equal size when some were
        dropped; ``one_token``: also for samples of one token (a sketch's FFT route, which sums
        by class with one indexed add, not a product per class)."""
        return None

    def direct_sums(self, want_weight: bool, want_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The same sums from a faster exact kernel (Conv: one grouped convolution backward,
        which never forms patches), or None to form them from the tokens."""
        return None


def class_outer_sums(factors: OuterFactors, out: LayerRows) -> None:
    """Per-class weight (and bias) gradients of an outer-product layer into ``out``."""
    if out.projection is not None:  # projected rows: weight and bias at once, by the unit's structure
        projected_sums("outer", out.projection)(factors, out, out.projection)
        return
    direct = factors.direct_sums(out.wants("weight"), out.wants("bias"))
    if direct is not None:
        gw, gb = (t if out.wants(kind) else None for kind, t in zip(("weight", "bias"), direct))
        # Bounded by their peak (one pass, read with the run): these are k copies of a layer's
        # parameters (45M floats for a ResNet-18 run of 4 classes, where an exact isfinite takes
        # four passes).
        out.bound_by_values(gw, gb)
        if gw is not None:
            out.put("weight", gw)
        if gb is not None:
            out.put("bias", gb)
        return
    # On a CPU, classes of unequal size: one product per class on its own slice of tokens (no
    # padded copies, no products of padding; a loop a GPU would pay for in launches).
    ragged = factors.ragged(live=True) if rule_io.cpu_routes(out.run.rows.device) else None
    if ragged is not None:
        _ragged_sums(ragged, out)
        return
    G = factors.grad_tokens()
    terms = G.shape[1]
    if out.wants("weight"):
        A = factors.input_tokens()
        # Finite factors with |g| * |x| * terms far below the float range cannot give an inf or
        # NaN row: one cheap check on the factors instead of a pass over the rows.
        out.bound(peak(G) * peak(A).clamp(min=1) * terms)
        # One product per class (no blocks): straight into the rows, no temporary, no copy.
        target = out.fresh("weight") if G.shape[0] == out.k else None
        if target is not None:
            torch.bmm(G.transpose(1, 2), A, out=target.view(out.k, G.shape[2], A.shape[2]))
        else:
            out.put("weight", torch.bmm(G.transpose(1, 2), A))
    else:
        out.bound(peak(G) * terms)
    if out.wants("bias"):
        out.put("bias", G.sum(dim=1))


def _ragged_sums(ragged: Ragged, out: LayerRows) -> None:
    """``class_outer_sums`` on unpadded tokens: ``torch.mm`` per class straight into its row."""
    G, A, tokens = ragged.grads, ragged.inputs, ragged.tokens
    terms = max(tokens)
    if out.wants("weight"):
        out.bound(peak(G) * peak(A).clamp(min=1) * terms)  # as in class_outer_sums
        target = out.fresh("weight")
        shape = (out.k, G.shape[1], A.shape[1])
        gw = target.view(shape) if target is not None else G.new_empty(shape)
        ragged.per_class_mm(G, A, gw)
        if target is None:
            out.put("weight", gw)
    else:
        out.bound(peak(G) * terms)
    if out.wants("bias"):
        out.put("bias", G.new_zeros(out.k, G.shape[1]).index_add_(0, ragged.owner(G.device), G))
