"""The layer rules for ``nn.Embedding`` and ``nn.EmbeddingBag``: per-class scatter-adds of the
output gradient into the rows of the table that each sample looked up.

Holds ``embedding_sums`` and ``embedding_bag_sums`` (the registered rules) and their ``applies``
checks (``embedding_refusal``, ``bag_refusal``).

An embedding's weight gradient for class i is ``dW_i[v] = sum of g_t`` over the tokens t of
class i's samples that looked up row v (a bag: its bag gradient, divided by the bag's size in
mode ``mean``; in mode ``max``, per feature, the row that won the max). The rule adds them
straight into the class's rows, viewed as ``[k, V, H]`` (one indexed accumulate, no per-class
loop); the ``padding_idx`` row stays zero, as torch leaves it. With projected rows
(``LayerRows.projection``) an Embedding's sums are its structure's (``registry.projected_sums``):
Kronecker projects the table as it is formed (``kronecker_sums.projected_embedding_sums``),
TensorSketch adds every lookup to its buckets (``sketch_sums``); no table is formed either way.

Refused (``applies`` says why; the engine then takes another exact path): ``max_norm`` (the
forward renormalises the looked-up rows of the weight in place), ``scale_grad_by_freq`` (the
gradient is divided by frequencies within the whole batch), and, for a bag, mode ``sum`` (it may
be given ``per_sample_weights``, an argument of the call, which the hooks do not see). A bag
called with a 1-D input and ``offsets`` (bags are not samples) makes the rule raise, and the
engine falls back with a note.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from classgrad.workers.engines.layer_rules.registry import projected_sums, register_rule
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows, peak, sample_classes

BAG_MODES = {"sum": 0, "mean": 1, "max": 2}  # torch.embedding_bag's mode numbers


def _common_refusal(module: nn.Embedding | nn.EmbeddingBag) -> str | None:
    if module.sparse:
        return "sparse=True gives sparse gradients, which the engine's other paths must handle"
    if module.max_norm is not None:
        return "max_norm renormalises the weight in place during the forward"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq divides the gradient by frequencies within the batch"
    return None


def embedding_refusal(module: nn.Embedding) -> str | None:
    return _common_refusal(module)


def bag_refusal(module: nn.EmbeddingBag) -> str | None:
    if module.mode == "sum":
        return "mode 'sum' may be given per_sample_weights, which the hooks do not see"
    return _common_refusal(module)


def _write_table(
    module: nn.Embedding | nn.EmbeddingBag, seen: LayerCapture, out: LayerRows, fill: Callable[[torch.Tensor], object]
) -> None:
    """``fill`` adds into a zeroed ``[k, V, H]`` view of the class's rows (a temporary when this
    layer's rows were already written in this run: a module called twice); padding row zeroed."""
    V, H = module.weight.shape
    target = out.fresh("weight")
    if target is not None:
        table = target.view(out.k, V, H)
        table.zero_()
    else:
        table = torch.zeros(out.k, V, H, dtype=seen.grid.dtype, device=seen.grads.device)
    fill(table)
    if module.padding_idx is not None:
        table[:, module.padding_idx].zero_()
    if target is None:
        out.put("weight", table)


@register_rule(nn.Embedding, applies=embedding_refusal, kinds=("weight",))
def embedding_sums(module: nn.Embedding, seen: LayerCapture, out: LayerRows) -> None:
    if not out.wants("weight"):
        return
    if out.projection is not None:  # projected rows: the table's sums by the unit's structure
        projected_sums("embedding", out.projection)(module, seen, out, out.projection)
        return
    idx = seen.inputs
    H = module.weight.shape[1]
    positions = idx[0].numel() if idx.dim() > 1 else 1
    grads = seen.grads.to(seen.grid.dtype).reshape(-1, H)
    classes = sample_classes(seen).view(-1, *[1] * (idx.dim() - 1)).expand_as(idx).reshape(-1)
    # Each entry is a sum of at most width * positions token gradients.
    out.bound(peak(grads) * (seen.grid.width * positions))
    _write_table(module, seen, out, lambda table: table.index_put_((classes, idx.reshape(-1)), grads, accumulate=True))


@register_rule(nn.EmbeddingBag, applies=bag_refusal, kinds=("weight",))
def embedding_bag_sums(module: nn.EmbeddingBag, seen: LayerCapture, out: LayerRows) -> None:
    if not out.wants("weight"):
        return
    idx = seen.inputs
    if idx.dim() != 2:
        raise RuntimeError("EmbeddingBag called with a 1-D input and offsets: its bags are not the samples")
    total, length = idx.shape
    H = module.weight.shape[1]
    grads = seen.grads.to(seen.grid.dtype)  # [total, H]
    classes = sample_classes(seen)
    out.bound(peak(grads) * (seen.grid.width * length))
    if module.mode == "max":
        # The row that won each feature's max, as torch's own kernel picks it (ties included).
        offsets = torch.arange(0, total * length, length, device=idx.device)
        with torch.no_grad():
            *_, winners = torch.embedding_bag(
                module.weight.detach(),
                idx.reshape(-1),
                offsets,
                False,
                BAG_MODES["max"],
                False,
                None,
                False,
                module.padding_idx,
            )
        # A bag of padding only has no winner (-1, or the padding row, zeroed afterwards).
        found = winners >= 0
        features = torch.arange(H, device=idx.device).expand(total, H)

        if out.projection is not None:  # projected rows: each winning entry, by the unit's structure
            if module.padding_idx is not None:  # the padding row stays zero, as in the table
                found = found & (winners != module.padding_idx)
            # Bag t's feature h won at row winners[t, h]: entry (winners[t, h], h) of its class.
            values = (grads * found).to(grads.dtype)
            projected_sums("entries", out.projection)(
                out, out.projection, classes, winners.clamp(min=0), features, values
            )
            return

        def fill(table: torch.Tensor) -> None:
            where = (classes.view(-1, 1).expand(total, H), winners.clamp(min=0), features)
            table.index_put_(where, grads * found, accumulate=True)

    else:  # mean: each entry's share of its bag's gradient (padding entries count for nothing)
        keep = (idx != module.padding_idx) if module.padding_idx is not None else torch.ones_like(idx, dtype=torch.bool)
        share = keep.to(grads.dtype) / keep.sum(dim=1, keepdim=True).clamp(min=1).to(grads.dtype)
        if out.projection is not None:  # projected rows: each entry's share, by the unit's structure
            values = (grads.unsqueeze(1) * share.unsqueeze(2)).reshape(-1, H)  # one pass, no repeated copy
            sums = projected_sums("entries", out.projection)
            sums(out, out.projection, classes.repeat_interleave(length), idx.reshape(-1), None, values)
            return

        def fill(table: torch.Tensor) -> None:
            values = (grads.unsqueeze(1) * share.unsqueeze(2)).reshape(-1, H)
            where = (classes.view(-1, 1).expand(total, length).reshape(-1), idx.reshape(-1))
            table.index_put_(where, values, accumulate=True)

    _write_table(module, seen, out, fill)
