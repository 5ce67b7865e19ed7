"""Dense rows through the model's final Linear layer, for losses linear in the outputs.

Holds ``HeadBasis``: what the dense engine needs to write any row of such a loss without a VJP
per row, built in one pass over the probe set, and ``head_basis``, which builds it or says why
it cannot.

The mathematics. Let the model end in a Linear layer, outputs ``out = h W^T + b`` with ``h``
``[N, F]``, and let the loss be linear in the outputs with sample weights that do not depend on
the class: ``L_c = sum_n w_n out[n, c]`` (the ``logit`` loss: ``w_n = 1/N``). Then row c is

- for ``W``: zero except its row c, which is ``s = sum_n w_n h_n`` (``[F]``); for ``b``: zero
  except entry c, which is ``sum_n w_n``;
- for every parameter ``theta`` below the head:
  ``dL_c/dtheta = sum_j W[c, j] R_j`` with ``R_j = d(sum_n w_n h_n[j])/dtheta``.

So F VJPs (one per feature, summed over micro-batches) replace C of them, and the rows of any
classes are one matrix product, ``W[classes] @ R``. With C = 10,000 classes on 512 features
that is 20x fewer backward passes; the arithmetic is the same up to summation order.

Applies only when every condition holds (else the dense engine runs its VJPs per row, with a
note saying why): the loss declares ``linear_in_outputs``; no fp16 loss scaling (fp32, bf16
and fp64 qualify); the model's output is the output of one ``nn.Linear`` called once per
forward, with ``F < C``, no forward hooks, and parameters used nowhere else (checked on the
graph); the loss's cotangent is the same in every column (checked on every micro-batch);
``R`` (F x D_body floats) fits ``ROW_BYTES_BUDGET``.

Memory: ``R`` is held while rows are written and kept by the engine for later calls (an actor's
next shard needs the same ``R``) until a parameter changes; it does not grow with C.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn

from workers.engines.base import reaches_any
from workers.layout import ParamLayout, ParamSlot

_FP_BYTES = 4


class NoHeadPath(Exception):
    """Raised (and caught by the dense engine) when rows cannot go through the head.
    ``lasting``: the reason is the model's or the loss's structure, not this call's values."""

    def __init__(self, reason: str, lasting: bool = True):
        super().__init__(reason)
        self.lasting = lasting


@dataclass
class HeadBasis:
    """Everything rows need, summed over the probe set (see the module docstring)."""

    head: nn.Linear
    basis: torch.Tensor  # R [F, D_body], in row dtype
    feature_sum: torch.Tensor  # s = sum_n w_n h_n [F]
    weight_sum: torch.Tensor  # sum_n w_n []
    losses: torch.Tensor  # L [C]
    body_runs: list[tuple[int, int, int]]  # (offset in a row, offset in R, size): consecutive body columns
    head_slots: dict[str, ParamSlot]  # "weight"/"bias" of the head, where selected
    dim: int  # D, the length of a row
    versions: tuple[int, ...]  # parameter versions R was computed at

    def rows(self, classes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[k, D]`` of ``classes`` (a device tensor)."""
        k = len(classes)
        rows = torch.empty(k, self.dim, dtype=dtype, device=self.basis.device)
        weight = self.head.weight.detach()[classes].to(dtype)
        for row_at, basis_at, size in self.body_runs:
            torch.mm(weight, self.basis[:, basis_at : basis_at + size], out=rows[:, row_at : row_at + size])
        picks = torch.arange(k, device=rows.device)
        if "weight" in self.head_slots:
            slot = self.head_slots["weight"]
            cols = rows[:, slot.offset : slot.offset + slot.size]
            cols.zero_()
            cols.view(k, *slot.shape)[picks, classes] = self.feature_sum.to(dtype)
        if "bias" in self.head_slots:
            slot = self.head_slots["bias"]
            cols = rows[:, slot.offset : slot.offset + slot.size]
            cols.zero_()
            cols[picks, classes] = self.weight_sum.to(dtype)
        return rows


def parameter_versions(model: nn.Module) -> tuple[int, ...]:
    return tuple(p._version for p in model.parameters())


def _head_candidates(engine) -> list[nn.Linear]:
    """Linear layers that could be the head, checked before any forward pass."""
    from torch.nn.modules import module as module_state

    if not getattr(engine.loss, "linear_in_outputs", False):
        raise NoHeadPath(f"loss {engine.loss.name!r} is not declared linear in the outputs")
    if engine.precision.first_scale != 1:
        raise NoHeadPath("fp16 loss scaling works row by row")
    if module_state._global_forward_hooks or module_state._global_forward_pre_hooks:
        raise NoHeadPath("global module hooks may change the head's output")
    num_classes = engine.loss.num_classes
    uses = collections.Counter(id(p) for _, p in engine.model.named_parameters(remove_duplicate=False))
    found = [
        m for m in engine.model.modules()
        if type(m) is nn.Linear and m.out_features == num_classes and m.in_features < num_classes
        and not (m._forward_hooks or m._forward_pre_hooks)
        and all(uses[id(p)] == 1 for p in m.parameters())
    ]
    if not found:
        raise NoHeadPath(f"no final nn.Linear with fewer input features than its {num_classes} outputs")
    return found


def head_basis(engine, row_bytes_budget: int) -> HeadBasis:
    """One pass over the probe set: ``R``, ``s``, ``sum w`` and ``L``. Raises ``NoHeadPath``."""
    candidates = _head_candidates(engine)
    layout: ParamLayout = engine.layout
    dtype = torch.promote_types(engine.compute_dtype, torch.float32)
    basis = feature_sum = weight_sum = head = None
    losses = torch.zeros(engine.loss.num_classes, dtype=dtype, device=engine.device)
    body_layout: ParamLayout | None = None
    body_params: list[torch.Tensor] = []
    for number, mb in enumerate(engine.probe.micro_batches()):
        x, y = engine.probe.batch(mb.indices, engine.device, engine.compute_dtype)
        calls: dict[nn.Module, list] = {m: [] for m in candidates}

        def keep(module, args, output):
            calls[module].append((args[0] if args else None, output))

        handles = [m.register_forward_hook(keep) for m in candidates]
        try:
            with engine.forward_context(mb.index):
                out = engine.model(x)
        finally:
            for h in handles:
                h.remove()
        engine.stats.forwards += 1
        engine.loss.check_outputs(out)
        found = [m for m, seen in calls.items() if len(seen) == 1 and seen[0][1] is out]
        if len(found) != 1 or (head is not None and found[0] is not head):
            raise NoHeadPath("the model's output is not the output of one nn.Linear called once")
        if head is None:
            head = found[0]
            selected = set(layout.names)
            head_slots = {kind: layout.slot(f"{name}.{kind}") for name, m in engine.model.named_modules() if m is head
                          for kind in ("weight", "bias") if f"{name}.{kind}" in selected}
            head_ids = {id(p) for p in head.parameters()}
            body = [(s, p) for s, p in zip(layout.slots, engine.params) if id(p) not in head_ids]
            body_layout, offset = [], 0
            for s, _ in body:
                body_layout.append(ParamSlot(s.name, s.shape, offset, s.size))
                offset += s.size
            features = head.in_features
            if features * offset * _FP_BYTES > row_bytes_budget:
                raise NoHeadPath(f"{features} x {offset:,} basis floats exceed the row memory budget")
            body_layout = ParamLayout(body_layout)
            body_params = [p for _, p in body]
            body_runs = _runs([s for s, _ in body], body_layout)
            basis = torch.zeros(features, offset, dtype=dtype, device=engine.device)
            feature_sum = torch.zeros(features, dtype=dtype, device=engine.device)
            weight_sum = torch.zeros((), dtype=dtype, device=engine.device)
        h = calls[head][0][0]
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != head.in_features:
            raise NoHeadPath("the head's input is not [batch, features]")
        if h.requires_grad and reaches_any(h.grad_fn, head_ids):
            raise NoHeadPath("the head's parameters are also used below it")
        if not out.requires_grad:
            raise NoHeadPath("the outputs do not depend on the selected parameters")
        contrib = engine.loss.batch_losses(out, y, engine.norm)
        engine.check_finite_loss(contrib.detach(), torch.arange(engine.loss.num_classes))
        losses += contrib.detach().to(dtype)
        (grad_out,) = torch.autograd.grad(contrib.sum(), out, retain_graph=bool(body_params) and h.requires_grad)
        engine.stats.backwards += 1
        weights = grad_out[:, 0]
        if not torch.equal(grad_out, weights.unsqueeze(1).expand_as(grad_out)):
            raise NoHeadPath(f"loss {engine.loss.name!r} weighs samples differently per class")
        feature_sum += weights.to(dtype) @ h.detach().to(dtype)
        weight_sum += weights.to(dtype).sum()
        if body_params and h.requires_grad:
            cot = torch.zeros_like(h)
            last = head.in_features - 1
            for j in range(head.in_features):
                cot[:, j] = weights.to(cot.dtype)
                grads = torch.autograd.grad(h, body_params, grad_outputs=cot, retain_graph=j < last, allow_unused=True)
                cot[:, j] = 0
                engine.stats.backwards += 1
                if number == 0:  # the first micro-batch writes its rows of R in place
                    if any(g is not None for g in grads):
                        body_layout.flatten(grads, out=basis[j])
                elif any(g is not None for g in grads):
                    basis[j] += body_layout.flatten(grads).to(dtype)
        del out, contrib, h
    if head is None:
        raise NoHeadPath("the probe set is empty")
    if not (bool(torch.isfinite(basis.sum())) and bool(torch.isfinite(feature_sum).all())):
        raise NoHeadPath("non-finite gradients: rows are checked one by one", lasting=False)
    return HeadBasis(head, basis, feature_sum, weight_sum, losses, body_runs, head_slots, layout.dim,
                     parameter_versions(engine.model))


def _runs(body_slots: list[ParamSlot], body_layout: ParamLayout) -> list[tuple[int, int, int]]:
    """Consecutive body columns as (offset in a row, offset in R, size), so each run of
    parameters next to each other in a row is one matrix product."""
    runs: list[tuple[int, int, int]] = []
    for full, compact in zip(body_slots, body_layout.slots):
        if runs and runs[-1][0] + runs[-1][2] == full.offset:
            row_at, basis_at, size = runs[-1]
            runs[-1] = (row_at, basis_at, size + full.size)
        else:
            runs.append((full.offset, compact.offset, full.size))
    return runs
