"""Dense rows through the model's final Linear layer, for losses that see each output column
on its own.

Holds:
- ``head_basis`` / ``HeadBasis``: for a loss linear in the outputs, a basis of F VJPs from one
  pass over the probe set that gives any row as a matrix product;
- ``head_graph`` / ``HeadGraph``: for a loss whose L_c depends on output column c only, one
  micro-batch's graph up to the head's input, whose row VJPs skip the loss and the head;
- ``NoHeadPath``: raised with the reason when a path does not apply (the dense engine then
  runs its VJPs through the whole model, and notes why).

The mathematics. Let the model end in a Linear layer, outputs ``out = h W^T + b`` with ``h``
``[N, F]``, and let L_c depend on the outputs only through column c (``per_column`` losses:
``logit``, ``bce``). With ``a = d(sum_c L_c)/d out`` (``[N, C]``, one VJP), row c is

- for ``W``: zero except its row c, which is ``sum_n a[n, c] h_n``; for ``b``: zero except
  entry c, ``sum_n a[n, c]``;
- for every parameter ``theta`` below the head: the VJP of ``h`` with the rank-one cotangent
  ``a[:, c] W[c]``: a backward through the body only, where the usual VJP of L_c also runs
  back through the loss and the head (``N x C x F`` multiply-adds per row, which for a small
  body and many classes is most of the work).

If the loss is also linear in the outputs with weights that do not depend on the class,
``L_c = sum_n w_n out[n, c]`` (``logit``: ``w_n = 1/N``, so every column of ``a`` is ``w``), the
body part of row c is ``sum_j W[c, j] R_j`` with ``R_j = d(sum_n w_n h_n[j])/d theta``: F VJPs
(one per feature, summed over micro-batches) replace C, and the rows of any classes are one
matrix product, ``W[classes] @ R``. With C = 10,000 classes on 512 features that is 20x fewer
backward passes.

Both are exact (the same arithmetic up to summation order) and apply only when every condition
holds: the loss declares ``per_column`` (``linear_in_outputs`` for the basis); no fp16 loss
scaling; the model's output is the output of one ``nn.Linear`` called once per forward, with no
forward hooks and parameters used nowhere else (checked on the graph); for the basis also
``F < C``, the loss's gradient equal in every column (checked on every micro-batch) and ``R``
(F x D_body floats) within the row memory budget.

Memory: ``R`` is kept by the engine for later calls (an actor's next shard needs the same
``R``) until a parameter changes; neither path grows with C beyond a block of rows.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn

from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.base import reaches_any
from classgrad.workers.layout import ParamLayout

_FP_BYTES = 4


class NoHeadPath(Exception):
    """Raised (and caught by the dense engine) when rows cannot go through the head.
    ``lasting``: the reason is the model's or the loss's structure, not this call's values."""

    def __init__(self, reason: str, lasting: bool = True):
        super().__init__(reason)
        self.lasting = lasting


def parameter_versions(model: nn.Module) -> tuple[int, ...]:
    return tuple(p._version for p in model.parameters())


@dataclass
class HeadSplit:
    """The head and the selected parameters on either side of it."""

    head: nn.Linear
    head_slots: dict[str, ParamSlot]  # "weight"/"bias" of the head, where selected
    body_params: list[torch.Tensor]  # selected parameters below the head, in row order
    body_layout: ParamLayout  # their columns, packed (offsets into R)
    body_runs: list[tuple[int, int, int]]  # (offset in a row, offset in R, size) of consecutive columns

    @classmethod
    def of(cls, engine, head: nn.Linear) -> HeadSplit:
        layout: ParamLayout = engine.layout
        selected = set(layout.names)
        head_slots = {
            kind: layout.slot(f"{name}.{kind}")
            for name, m in engine.model.named_modules()
            if m is head
            for kind in ("weight", "bias")
            if f"{name}.{kind}" in selected
        }
        head_ids = {id(p) for p in head.parameters()}
        body = [(s, p) for s, p in zip(layout.slots, engine.params) if id(p) not in head_ids]
        packed, offset = [], 0
        for s, _ in body:
            packed.append(ParamSlot(s.name, s.shape, offset, s.size))
            offset += s.size
        body_layout = ParamLayout(packed)
        runs: list[tuple[int, int, int]] = []
        for (full, _), compact in zip(body, body_layout.slots):
            if runs and runs[-1][0] + runs[-1][2] == full.offset:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + full.size)
            else:
                runs.append((full.offset, compact.offset, full.size))
        return cls(head, head_slots, [p for _, p in body], body_layout, runs)

    def runs_through_body(self, h: torch.Tensor) -> bool:
        """Whether rows need VJPs below the head: selected parameters there, and a graph to them."""
        return bool(self.body_params) and h.requires_grad


def _head_candidates(engine, declared: str) -> list[nn.Linear]:
    """Linear layers that could be the head, checked before any forward pass; ``declared``
    names the loss property the path needs."""
    from torch.nn.modules import module as module_state

    if not getattr(engine.loss, declared, False):
        raise NoHeadPath(f"loss {engine.loss.name!r} is not declared {declared.replace('_', ' ')}")
    if engine.precision.first_scale != 1:
        raise NoHeadPath("fp16 loss scaling works on the whole backward")
    if module_state._global_forward_hooks or module_state._global_forward_pre_hooks:
        raise NoHeadPath("global module hooks may change the head's output")
    num_classes = engine.loss.num_classes
    uses = collections.Counter(id(p) for _, p in engine.model.named_parameters(remove_duplicate=False))
    found = [
        m
        for m in engine.model.modules()
        if type(m) is nn.Linear
        and m.out_features == num_classes
        and not (m._forward_hooks or m._forward_pre_hooks)
        and all(uses[id(p)] == 1 for p in m.parameters())
    ]
    if not found:
        raise NoHeadPath(f"no nn.Linear with {num_classes} outputs, unhooked and unshared")
    return found


def _forward_to_head(engine, mb, candidates: list[nn.Linear], head: nn.Linear | None):
    """The engine's forward of one micro-batch, watching the candidates:
    ``(outputs, contribution to L, h, head)``."""
    calls: dict[nn.Linear, list] = {m: [] for m in candidates}

    def keep(module, args, output):
        calls[module].append((args[0] if args else None, output))

    handles = [m.register_forward_hook(keep) for m in candidates]
    try:
        out, contrib = engine.forward(mb)
    finally:
        for handle in handles:
            handle.remove()
    found = [m for m, seen in calls.items() if len(seen) == 1 and seen[0][1] is out]
    if len(found) != 1 or (head is not None and found[0] is not head):
        raise NoHeadPath("the model's output is not the output of one nn.Linear called once")
    head = found[0]
    h = calls[head][0][0]
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != head.in_features:
        raise NoHeadPath("the head's input is not [batch, features]")
    if h.requires_grad and reaches_any(h.grad_fn, {id(p) for p in head.parameters()}):
        raise NoHeadPath("the head's parameters are also used below it")
    if not out.requires_grad:
        raise NoHeadPath("the outputs do not depend on the selected parameters")
    return out, contrib, h, head


# --- losses linear in the outputs: a basis of F VJPs -------------------------------------------


@dataclass
class HeadBasis:
    """Everything rows of a linear loss need, summed over the probe set."""

    split: HeadSplit
    basis: torch.Tensor  # R [F, D_body], in row dtype
    feature_sum: torch.Tensor  # s = sum_n w_n h_n [F]
    weight_sum: torch.Tensor  # sum_n w_n []
    losses: torch.Tensor  # L [C]
    dim: int  # D, the length of a row
    versions: tuple[int, ...]  # parameter versions R was computed at

    def rows(self, classes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[k, D]`` of ``classes`` (a device tensor)."""
        k, split = len(classes), self.split
        rows = torch.empty(k, self.dim, dtype=dtype, device=self.basis.device)
        weight = split.head.weight.detach()[classes].to(dtype)
        for row_at, basis_at, size in split.body_runs:
            torch.mm(weight, self.basis[:, basis_at : basis_at + size], out=rows[:, row_at : row_at + size])
        picks = torch.arange(k, device=rows.device)
        if "weight" in split.head_slots:
            slot = split.head_slots["weight"]
            cols = rows[:, slot.offset : slot.offset + slot.size]
            cols.zero_()
            cols.view(k, *slot.shape)[picks, classes] = self.feature_sum.to(dtype)
        if "bias" in split.head_slots:
            slot = split.head_slots["bias"]
            cols = rows[:, slot.offset : slot.offset + slot.size]
            cols.zero_()
            cols[picks, classes] = self.weight_sum.to(dtype)
        return rows


def head_basis(engine, row_bytes_budget: int) -> HeadBasis:
    """One pass over the probe set: ``R``, ``s``, ``sum w`` and ``L``. Raises ``NoHeadPath``."""
    candidates = [m for m in _head_candidates(engine, "linear_in_outputs") if m.in_features < engine.loss.num_classes]
    if not candidates:
        raise NoHeadPath(f"the head has at least as many input features as its {engine.loss.num_classes} outputs")
    dtype = engine.row_dtype
    split = basis = feature_sum = weight_sum = None
    losses = torch.zeros(engine.loss.num_classes, dtype=dtype, device=engine.device)
    for number, mb in enumerate(engine.probe.micro_batches()):
        out, contrib, h, head = _forward_to_head(engine, mb, candidates, split.head if split else None)
        if split is None:
            split = HeadSplit.of(engine, head)
            features, body_dim = head.in_features, split.body_layout.dim
            if features * body_dim * _FP_BYTES > row_bytes_budget:
                raise NoHeadPath(f"{features} x {body_dim:,} basis floats exceed the row memory budget")
            basis = torch.zeros(features, body_dim, dtype=dtype, device=engine.device)
            feature_sum = torch.zeros(features, dtype=dtype, device=engine.device)
            weight_sum = torch.zeros((), dtype=dtype, device=engine.device)
        assert basis is not None and feature_sum is not None and weight_sum is not None  # made with split
        body = split.runs_through_body(h)
        engine.check_finite_loss(contrib.detach(), torch.arange(engine.loss.num_classes))
        losses += contrib.detach().to(dtype)
        (grad_out,) = torch.autograd.grad(contrib.sum(), out, retain_graph=body)
        engine.stats.backwards += 1
        weights = grad_out[:, 0]
        if not torch.equal(grad_out, weights.unsqueeze(1).expand_as(grad_out)):
            raise NoHeadPath(f"loss {engine.loss.name!r} weighs samples differently per class")
        feature_sum += weights.to(dtype) @ h.detach().to(dtype)
        weight_sum += weights.to(dtype).sum()
        if body:
            cot = torch.zeros_like(h)
            last = head.in_features - 1
            for j in range(head.in_features):
                cot[:, j] = weights.to(cot.dtype)
                grads = torch.autograd.grad(
                    h, split.body_params, grad_outputs=cot, retain_graph=j < last, allow_unused=True
                )
                cot[:, j] = 0
                engine.stats.backwards += 1
                if all(g is None for g in grads):
                    continue
                if number == 0:  # the first micro-batch writes its rows of R in place
                    split.body_layout.flatten(grads, out=basis[j])
                else:
                    basis[j] += split.body_layout.flatten(grads).to(dtype)
        del out, contrib, h
    if split is None:
        raise NoHeadPath("the probe set is empty")
    assert basis is not None and feature_sum is not None and weight_sum is not None  # made with split
    if not (bool(torch.isfinite(basis.sum())) and bool(torch.isfinite(feature_sum).all())):
        raise NoHeadPath("non-finite gradients: rows are checked one by one", lasting=False)
    return HeadBasis(split, basis, feature_sum, weight_sum, losses, engine.layout.dim, parameter_versions(engine.model))


# --- losses that see each output column on its own: VJPs through the body only ------------------


class HeadGraph:
    """One micro-batch's graph up to the head's input, for a ``per_column`` loss. Its VJP
    methods take class ids and loss scales (the dense engine's interface for every graph) and
    return gradients in row order: the body's from a backward that starts at ``h``, the head's
    written directly."""

    def __init__(
        self,
        values: torch.Tensor,
        h: torch.Tensor,
        column_grads: torch.Tensor,
        split: HeadSplit,
        params: list[torch.Tensor],
        row_dtype: torch.dtype,
    ):
        self.values = values  # this micro-batch's contribution to L [C]
        self._h, self._a, self._split, self._dtype = h, column_grads, split, row_dtype
        self._order = [id(p) for p in params]  # row order of every selected parameter
        self._body = split.runs_through_body(h)

    def _grads(self, classes: torch.Tensor, scales: torch.Tensor, batched: bool) -> list[torch.Tensor | None]:
        split, h = self._split, self._h
        k = len(classes)
        dtype = self._dtype
        a = self._a[:, classes].t().to(dtype) * scales.to(self._a.device, dtype).unsqueeze(1)  # [k, N]
        weight = split.head.weight.detach()[classes].to(dtype)  # [k, F]
        found: dict[int, torch.Tensor | None] = {}
        if self._body:
            cot = (a.unsqueeze(2) * weight.unsqueeze(1)).to(h.dtype)  # [k, N, F]: a[:, c] W[c] per row
            grads = torch.autograd.grad(
                h,
                split.body_params,
                grad_outputs=cot if batched else cot[0],
                is_grads_batched=batched,
                retain_graph=True,
                allow_unused=True,
            )
            found.update(zip((id(p) for p in split.body_params), grads))
        picks = torch.arange(k, device=a.device)
        head = split.head
        if "weight" in split.head_slots:
            gw = torch.zeros(k, *head.weight.shape, dtype=dtype, device=a.device)
            gw[picks, classes] = a @ h.detach().to(dtype)
            found[id(head.weight)] = gw if batched else gw[0]
        if "bias" in split.head_slots:
            gb = torch.zeros(k, head.out_features, dtype=dtype, device=a.device)
            gb[picks, classes] = a.sum(dim=1)
            found[id(head.bias)] = gb if batched else gb[0]
        return [found.get(i) for i in self._order]

    def batched(self, classes: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor | None]:
        return self._grads(classes, scales, batched=True)

    def single(self, c: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor | None]:
        return self._grads(c.view(1), scale.view(1), batched=False)


def head_graph(engine, mb, split: HeadSplit | None) -> tuple[HeadGraph, HeadSplit]:
    """The head graph of micro-batch ``mb`` (``split``: from an earlier micro-batch, or None)."""
    candidates = _head_candidates(engine, "per_column")
    out, contrib, h, head = _forward_to_head(engine, mb, candidates, split.head if split else None)
    split = split or HeadSplit.of(engine, head)
    (column_grads,) = torch.autograd.grad(contrib.sum(), out, retain_graph=split.runs_through_body(h))
    engine.stats.backwards += 1
    return HeadGraph(contrib.detach(), h, column_grads.detach(), split, engine.params, engine.row_dtype), split
