"""Rows of one training batch's classes: the two routes of ``PerClassGradScaler.step_batch``.

Holds:
- ``ambient_precision``: the precision of the autocast the caller runs under (fp32, fp16, bf16).
- ``fast_rows``: the rows of the classes present in a batch through the partitioned engine's
  hook path (``classgrad.workers.engines.partitioned``), about one forward+backward over the
  batch, for a model that treats samples independently in its current mode, or whose only
  coupling is train-mode dropout (its masks drawn from the caller's generator as the batch's
  samples go through, each sample forwarded once: ``OneForwardRefused`` when that cannot be);
  an overflow or a non-finite loss is reported, not raised, so that the caller can skip the
  step as ``GradScaler`` would.
- ``batch_loss_vector``: the general route's per-class loss vector of a batch: one forward of
  the batch as given (the caller's RNG draws the dropout masks; train-mode BatchNorm uses, and
  updates, the batch's statistics, once, as the user's own step would), then the mean
  cross-entropy of each class present, whose rows ``LossRows`` computes.

Loss: mean cross-entropy over each class's samples in the batch, as the engines' ``cross_entropy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from classgrad.errors import ClassgradError, InputError, NonFiniteError, RowOverflowError, first_line
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.engines import host_device
from classgrad.workers.engines.base import without_draws
from classgrad.workers.engines.layer_rules.rule_io import sum_is_finite
from classgrad.workers.engines.partitioned import PartitionedEngine
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import check_label_range, create_loss
from classgrad.workers.model_io import ModelIO
from classgrad.workers.probe import ProbeSet, tree_map_tensors

AUTOCAST_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def ambient_precision(device: torch.device) -> str:
    """fp16 or bf16 when the caller runs under ``torch.autocast`` for ``device``, else fp32."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return "fp32"
    return AUTOCAST_NAMES.get(torch.get_autocast_dtype(kind), "fp32")


# Autograd nodes looked at for an fp16 graph: enough for the models of a training step's head and
# body as far as a cast to fp16 is (autocast casts at every matmul), bounded for huge graphs.
GRAPH_NODES_LOOKED_AT = 2000


def fp16_graph(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph holds an fp16 tensor (its forward ran under an fp16 autocast, or
    in half precision), when the call itself is outside any autocast: the saved tensors of its
    nodes, a bounded walk."""
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack and len(seen) < GRAPH_NODES_LOOKED_AT:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed
                    continue
                if isinstance(value, torch.Tensor) and value.dtype == torch.float16:
                    return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def check_labels(labels: Any, num_classes: int, size: int | None) -> torch.Tensor:
    """Integer class labels ``[N]`` in ``[0, num_classes)``, on the host; one line otherwise."""
    if not isinstance(labels, torch.Tensor) or labels.ndim != 1 or labels.is_floating_point() or len(labels) == 0:
        shown = list(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise InputError(f"labels must be integer class labels [N] (N > 0), got {shown}")
    if size is not None and size != len(labels):
        raise InputError(f"inputs hold {size} samples but labels {len(labels)}")
    # The step's one read of its labels: the host plans the run from them (classes present,
    # their samples), and checks them, without another read from the device.
    labels = host_device.to_host(labels).long()
    check_label_range(labels, num_classes)
    return labels


def batch_size_of(inputs: Any) -> int | None:
    """The leading size of the first tensor in ``inputs`` (a tensor or a nest of them)."""
    found: list[int] = []
    tree_map_tensors(lambda t: found.append(len(t)) if t.ndim else None, inputs)
    return found[0] if found else None


def fast_rows(
    model: nn.Module,
    inputs: Any,
    labels: torch.Tensor,
    *,
    num_classes: int,
    layout: ParamLayout,
    precision: str,
    scale: float,
    output: str | int | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, bool | None]:
    """``(rows, class_ids, found_inf)`` of the classes present in the batch, by the partitioned
    engine; fp16 rows at loss scale ``scale`` (never a smaller one: an overflow is ``found_inf``).
    ``found_inf`` None: every row is finite but their sum is unknown (the caller checks it);
    False: the sum too is finite for sure (the hook path bounded every entry: no read)."""
    device = next(model.parameters()).device
    class_ids = torch.unique(labels)  # host labels (check_labels)
    # One run over the whole batch: the probe's batch size is the batch, and the group holds
    # every class present.
    probe = ProbeSet((inputs, labels), batch_size=len(labels), digest_now=False)
    policy = PrecisionPolicy(precision, init_scale=scale, min_scale=scale) if precision == "fp16" else None
    engine = PartitionedEngine(
        model,
        probe,
        create_loss("cross_entropy", num_classes),
        layout,
        precision=policy or PrecisionPolicy(precision),
        device=device,
        group_rows=max(1, len(class_ids)),
        output=output,
        draws_from_caller=True,
    )
    rows = out if out is not None else torch.empty(len(class_ids), layout.dim, device=device)
    with torch.autocast(device.type, enabled=False):  # the engine's own autocast, forward only
        try:
            for _ in engine.iter_blocks(class_ids.tolist(), out=rows):
                pass
        except RowOverflowError:
            rows.fill_(float("inf"))
            return rows, class_ids, True
        except NonFiniteError:  # a non-finite loss or row (fp32, bf16): GradScaler would skip
            rows.fill_(float("nan"))
            return rows, class_ids, True
    bounded = engine.stats.bounded_rows == len(class_ids) and sum_is_finite(len(class_ids))
    return rows, class_ids, False if bounded else None


def input_signature(inputs: Any) -> tuple:
    """What a forward check of ``inputs`` holds for: each tensor's dtype and shape after the batch."""
    out: list = []

    def note(t: torch.Tensor) -> torch.Tensor:
        out.append((t.dtype, tuple(t.shape[1:])))
        return t

    tree_map_tensors(note, inputs)
    return tuple(out)


def check_forward(model: nn.Module, inputs: Any, *, num_classes: int, output: str | int | None) -> None:
    """One forward, without a graph, of the batch's first two samples: inputs the model cannot
    take, or outputs that are not ``[N, num_classes]``, refused in one line (the fast route's
    engine would otherwise try its slower paths on them first, saying so, then fail raw)."""
    device = next(model.parameters()).device
    head = tree_map_tensors(lambda t: t[:2].to(device), inputs)
    try:
        with torch.no_grad(), without_draws(model):  # the caller's generator is the rows' alone
            logits = ModelIO(model, output, device)(head)
    except ClassgradError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's model cannot take the user's inputs
        raise InputError(
            f"step_batch: the model's forward failed on the inputs: {first_line(exc, with_type=True)}"
        ) from None
    if logits.ndim != 2 or logits.shape[1] != num_classes:
        raise InputError(
            f"step_batch: the model's outputs are [N, {logits.shape[-1]}], not [batch, num_classes={num_classes}]: "
            "give num_classes= (of step_batch or PerClassGradScaler) the width of model(inputs)"
        )


def batch_loss_vector(
    model: nn.Module, inputs: Any, labels: torch.Tensor, *, num_classes: int, output: str | int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, class_ids)``: the mean cross-entropy of each class present, with the graph of one
    forward of the batch as given, under the caller's autocast and RNG."""
    device = next(model.parameters()).device
    x = tree_map_tensors(lambda t: t.to(device), inputs)
    logits = ModelIO(model, output, device)(x)
    if logits.ndim != 2 or logits.shape[1] != num_classes:
        raise InputError(f"model output has shape {list(logits.shape)}, expected [N, num_classes={num_classes}]")
    y = labels.to(device)
    class_ids, local = torch.unique(y, return_inverse=True)
    per_sample = F.cross_entropy(logits.float(), y, reduction="none")
    counts = torch.bincount(local, minlength=len(class_ids)).to(per_sample.dtype)
    loss = torch.zeros(len(class_ids), dtype=per_sample.dtype, device=device).index_add(0, local, per_sample)
    return loss / counts, class_ids.cpu()


def parameters_of(model: nn.Module, include: Sequence[str] | None) -> tuple[ParamLayout, list[nn.Parameter]]:
    layout = ParamLayout.from_model(model, include=list(include or ()))
    return layout, layout.parameters(model)
