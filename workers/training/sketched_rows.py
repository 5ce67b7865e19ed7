"""A training batch's per-class rows sketched inside a backward, and the step served by that backward.

Holds ``LogMap`` (a training log's map, of any structure that projects inside the backward,
planned once from the model's layout: the map a job's projection plans, nothing measured) and
``BatchRows`` (one batch's sketched rows with their classes, sample counts, mean losses and whether all are finite).

``LogMap.rows(model, inputs, labels)`` runs the partitioned engine's projected hook path over the
batch: one forward, one backward, each class's row (the mean cross-entropy of its samples in the
batch) formed as the map's ``dim`` columns inside the backward; no ``[k, D]`` row exists. With
``step`` the same forward and backward also give the gradient of the batch's mean cross-entropy
(``engines.base.StepGrads``: class ``c`` weighted ``n_c / N``, its rows still its own; the
gradient formed by the same layer rules from the same captures, the batch as one class) into
the parameters' ``.grad``: the training step and its rows from one forward and one backward.

Train-mode dropout draws its masks from the caller's generator as the batch's samples go through
(each sample forwarded once; ``PartitionedEngine(draws_from_caller=True)``). None when the hook
path cannot take the batch (a model that couples samples in its current mode, a layer outside
the rules, a loss scale that fp16 needs): the caller then takes
``PerClassGradScaler.step_batch``'s rows and sketches them whole (``LogMap.project``), the same
map.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from classgrad.errors import ClassgradError, NonFiniteError
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.engines.base import StepGrads, draws_only, samples_independent
from classgrad.workers.engines.partitioned.engine import draws_refused
from classgrad.workers.engines.partitioned.hook_plan import HookPlan
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine, ProjectedMap
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import create_loss
from classgrad.workers.probe import ProbeSet
from classgrad.workers.projection import ResolvedProjection
from classgrad.workers.training.batch_rows import ambient_precision, check_labels

log = logging.getLogger(__name__)

# A batch's run may pad its classes to this many batches (the engines' own micro-batches: 2), so
# that a batch of many small classes (256 samples, 223 classes of up to 3) is one run: one
# forward and one backward, not two half-batches.
PADDED_BATCHES = 4


@dataclass(frozen=True)
class BatchRows:
    """One batch's rows ``[k, dim]`` of ``class_ids`` (ascending, host), each class's samples
    ``counts`` and mean loss ``losses`` (host), and whether every row and loss is finite."""

    rows: torch.Tensor
    class_ids: torch.Tensor
    counts: torch.Tensor
    losses: torch.Tensor
    finite: bool


class LogMap:
    """A log's map of ``model``'s rows (``layout``): ``projection``'s structure planned from the
    model alone (its ``dim`` columns from its ``seed``)."""

    def __init__(self, model: nn.Module, layout: ParamLayout, projection: ResolvedProjection[Any]):
        plan = HookPlan.plan(model, layout)
        names = {m: n for n, m in model.named_modules()}
        # The modules the hook path handles get units; every other parameter is in the rest.
        self.covered = set() if plan is None else {names[m] for m in plan.layers}
        self.structure = projection.structure
        modules = dict(model.named_modules())
        self.kmap: ProjectedMap = projection.spec.plan(projection, layout.slots, modules, self.covered, None)
        self.layout = layout

    @property
    def dim(self) -> int:
        return int(self.kmap.dim)

    @property
    def out_dim(self) -> int:  # a ``RowProjector``: the log projects whole rows by it too
        return self.dim

    def describe(self) -> dict[str, Any]:
        return {**self.kmap.describe(), "structure": self.structure}

    def buffers(self) -> list[tuple[str, int, str]]:
        return []  # the map's own state is the units' (small); rows are the log's

    def project(self, full: torch.Tensor) -> torch.Tensor:
        """Whole rows ``[n, D]`` -> ``[n, dim]`` by the same map (the rows of another route)."""
        return self.kmap.project_full(full)

    def rows(
        self,
        model: nn.Module,
        inputs: Any,
        labels: torch.Tensor,
        *,
        num_classes: int,
        output: str | int | None = None,
        step: bool = False,
    ) -> BatchRows | None:
        """The batch's sketched rows (see the module docstring); with ``step`` the gradient of the
        batch's mean loss over the log's parameters added into their ``.grad`` (as
        ``loss.backward()`` leaves it). None when the hook path cannot take the batch (nothing
        then touched)."""
        device = next(model.parameters()).device
        precision = ambient_precision(device)
        if precision == "fp16" or not (samples_independent(model) or draws_only(model)) or draws_refused(model):
            return None  # fp16 needs a loss scale per step; coupled samples need the general route
        labels = check_labels(labels, num_classes, None)
        class_ids, counts = torch.unique(labels, return_counts=True)
        probe = ProbeSet((inputs, labels), batch_size=len(labels), digest_now=False)
        try:
            engine = ProjectedEngine(
                model,
                probe,
                create_loss("cross_entropy", num_classes),
                self.layout,
                plan=self._plan,
                structure=self.structure,
                precision=PrecisionPolicy(precision),
                device=device,
                group_rows=len(class_ids),
                output=output,
                draws_from_caller=True,
            )
        except (ClassgradError, RuntimeError) as exc:
            log.debug("training log: the hook path does not take this batch (%s)", exc)
            return None
        engine.padded_batches = PADDED_BATCHES
        total = len(labels)
        if step:
            engine.step = StepGrads({c: n / total for c, n in zip(class_ids.tolist(), counts.tolist())})
        rows = torch.empty(len(class_ids), self.dim, device=device, dtype=engine.row_dtype)  # float64 models: float64
        losses = torch.empty(len(class_ids))
        finite = True
        with torch.autocast(device.type, enabled=False):  # the engine's own autocast, forward only
            try:
                done = 0
                for block in engine.iter_blocks(class_ids.tolist(), out=rows):
                    losses[done : done + len(block)] = block.loss
                    done += len(block)
            except NonFiniteError:  # a non-finite loss or row: the step is skipped, as GradScaler would
                finite = False
            except ClassgradError as exc:  # the hook path failed on this batch (ProjectionRefused)
                log.debug("training log: the hook path does not take this batch (%s)", exc)
                return None
        gradient = engine.step.grads if engine.step is not None else None
        if step and finite:
            if gradient is None:  # another path took the run: no step gradient from it
                return None
            for p, g in zip(self.layout.parameters(model), self.layout.unflatten(gradient).values()):
                g = g.to(p.dtype)
                p.grad = g if p.grad is None else p.grad.add_(g)
        return BatchRows(rows, class_ids, counts, losses, finite)

    def _plan(self, engine: ProjectedEngine, modules: dict[str, nn.Module], covered: set[str]) -> ProjectedMap:
        """The engine's map: the log's own, planned once (the engine's covered layers must be the
        log's: the same model and parameters)."""
        if covered != self.covered:
            raise RuntimeError("the hook path covers other layers than the log's map was planned for")
        return self.kmap
