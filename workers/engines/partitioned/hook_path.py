"""The hook path: a run of consecutive classes from one forward and one backward, split by class.

Holds ``HookPath`` (a run's rows, and the one-off spot check against the plain single-class
path) and ``size_order`` (the order a CPU's run takes its classes in); the plan it follows
(which module handles each selected parameter, and how) is ``hook_plan.HookPlan``, re-exported
here.

A run's samples go through one ordinary forward (``capture.forward_capturing``) and one backward
that stops at the outputs of the handling modules. A module with a layer rule
(``classgrad.workers.engines.layer_rules``) turns its input and output gradient into per-class
gradients written straight into the row buffer; a module-VJP unit
(``layer_rules.module_vjp``) gets its per-class gradients from a VJP of that module alone on its
captured inputs, vmapped over the run's classes. No padding in the model's forward, no
per-sample gradients, no extra copy of the rows (but one of narrow rows on a CPU, whose runs take
their classes in order of size: ``size_order``). A module found not to be local on a run (a
parameter used outside it, an output with no sample dimension) hands its parameters to its
parent, and the run is done again. The first run on a model (per process, see
``choices.HOOKS_CHECKED``) is checked against the plain single-class path; any failure makes the
engine abandon the hooks for vmap (same rows).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from classgrad.errors import ClassgradError, first_line
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines import choices, host_device
from classgrad.workers.engines.base import GradientEngine, NormInFloat32
from classgrad.workers.engines.layer_rules import ClassGrid, ClassRows, LayerCapture
from classgrad.workers.engines.layer_rules.module_vjp import batch_dim, check_layout
from classgrad.workers.engines.layer_rules.rule_io import cpu_routes, token_liveness
from classgrad.workers.engines.partitioned.capture import Captured, Copies, NotLocal, UnitCall, forward_capturing
from classgrad.workers.engines.partitioned.hook_plan import HookPlan
from classgrad.workers.engines.partitioned.input_format import ImageFormat
from classgrad.workers.engines.partitioned.packing import ClassSamples
from classgrad.workers.losses import PartitionedLoss

log = logging.getLogger(__name__)

__all__ = ["HookPath", "HookPlan"]


@dataclass(frozen=True)
class RunPlan:
    """One run (a micro-batch of whole classes), planned on the host: ``classes`` and their
    ``counts`` (host), the samples to load (``indices``, class after class), the ``grid`` every
    layer rule gets (on the device), the loss scales and their inverse (on the device; None when
    all are 1). ``inv_on_rows``: the inverse applied once to the run's finished rows (``[k, dim]``)
    rather than to every layer's output gradient (``[total, ...]``, a CNN's largest tensors:
    9 ms of a logged step's 165); the sums are linear in it. Not in fp16, whose output gradients
    carry a loss scale of up to 2^24 and are unscaled, in the rows' dtype, before any rule reads
    them (as ``GradScaler`` unscales before the optimizer does)."""

    classes: torch.Tensor
    counts: torch.Tensor
    indices: torch.Tensor
    grid: ClassGrid
    scales: torch.Tensor | None
    inv: torch.Tensor | None
    inv_on_rows: bool = False


# On the CPU's routes, a run's classes in ascending order of their sample counts make each count's
# classes one slice of the run's samples, so the rules take them as views, not gathers (on a CNN's
# logged step at C = 10,000, 248 of 256 samples gathered per layer: 15 ms of 165). The rows then
# go back to the caller's order, one copy of ``[k, width]``: done only where rows are narrow (a
# projected map's).
ORDER_MAX_WIDTH = 1 << 16


def size_order(counts: list[int], width: int) -> torch.Tensor | None:
    """int64 ``[k]`` (host): the run's classes (of ``counts`` samples each) by count, ties in
    their order; None when they are in that order already or rows are wider than ``ORDER_MAX_WIDTH``."""
    if width > ORDER_MAX_WIDTH or all(a <= b for a, b in zip(counts, counts[1:])):
        return None
    return torch.argsort(torch.tensor(counts), stable=True)


# One class's row alone by the plain path: (class, loss scale [1], destination, where).
SingleClass = Callable[[int, torch.Tensor, torch.Tensor, slice], object]


class HookPath:
    """Rows of runs of consecutive classes from hooks, for one engine (``single``: its plain
    single-class path, which the spot check compares with)."""

    def __init__(self, engine: GradientEngine, plan: HookPlan, samples: ClassSamples, single: SingleClass):
        self.engine = engine
        self.plan = plan
        self.samples = samples
        self.single = single
        self.checked = self._check_key() in choices.HOOKS_CHECKED.get(engine.model, ())
        self.copies = Copies()  # modules whose outputs the model changes in place: copied
        self.lifts: list[str] = []  # modules whose parameters went to their parent, and why
        # Broadcast outputs ([1, ...]) handed on expanded to the run's samples (see capture), and
        # the modules whose outputs were expanded in the current run.
        self.expand = True
        self.expanded: list[nn.Module] = []
        self.formats = ImageFormat(engine.model)
        self.projections: dict = {}  # weight name -> Kronecker unit: rows projected inside the backward
        self._last_plan: RunPlan | None = None
        # The plan's layers at the full layout's columns (``_step_gradient``), made once.
        self._full_layers: dict[nn.Module, dict[str, ParamSlot]] | None = None

    def summary(self) -> str:
        """Which parameters this path handles and how (for the engine's one log line)."""
        lifted = f"; {len(self.lifts)} lifted ({self.lifts[0][:100]})" if self.lifts else ""
        return self.plan.summary() + lifted

    @property
    def layers(self) -> dict[nn.Module, dict[str, ParamSlot]]:
        return self.plan.layers

    def rows(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` at loss scales ``scales`` into ``dest[where]``: (losses, finite)."""
        while True:
            self.expanded = []
            try:
                return self._rows(classes, scales, dest, where)
            except NotLocal as exc:  # that module's parameters go to its parent; run again
                plan = self.plan.lifting(self.engine.model, self.engine.layout, exc.module)
                if plan is None:
                    raise RuntimeError(str(exc)) from None
                name = self.plan.names.get(exc.module) or "the model"
                self.lifts.append(f"{name} by its parent ({exc})")
                log.debug("partitioned: %s", self.lifts[-1])
                self.plan = plan
                self.checked = self._check_key() in choices.HOOKS_CHECKED.get(self.engine.model, ())
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - maybe an expanded broadcast output: once without
                if not (self.expand and self.expanded):
                    raise
                self.expand = False  # their modules are then found not local, and lifted
                self.lifts.append(f"broadcast outputs kept ({first_line(exc, with_type=True, limit=80)})")

    def _plan(self, classes: list[int], scales: torch.Tensor) -> RunPlan:
        """What the run's every layer needs to know of its classes, made on the host from the
        labels (no read from the device), kept while the next run has the same class sizes."""
        eng = self.engine
        cls = torch.tensor(classes)
        counts = eng.counts[cls]
        indices, _, _ = self.samples.consecutive(cls)
        sizes = tuple(counts.tolist())
        last = self._last_plan
        if last is not None and last.grid.sizes == sizes and last.grid.dtype == eng.row_dtype:
            grid = last.grid
        else:
            grid = ClassGrid.build(sizes, eng.row_dtype, eng.device)
        scaled = inv = None
        if bool((scales != 1).any()):
            scaled = host_device.to_device(scales.float(), eng.device)
            # A class with no samples in the run has a zero row whatever its scale (0 * inf: NaN).
            inverse = torch.where(counts > 0, 1.0 / scales.double(), 1.0)
            inv = host_device.to_device(inverse.to(eng.row_dtype), eng.device)
        plan = RunPlan(cls, counts, indices, grid, scaled, inv, eng.precision.dtype != "fp16")
        self._last_plan = plan
        return plan

    def _rows(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eng = self.engine
        order = None
        if cpu_routes(dest.device):  # a GPU's routes pad every class to one grid: no gathers by size
            order = size_order(eng.counts[torch.tensor(classes, dtype=torch.long)].tolist(), dest.shape[1])
        if order is not None:  # the run by class size, its rows put back in the caller's order
            k = len(classes)
            back = torch.empty_like(order)
            back[order] = torch.arange(k)
            buf = dest.new_empty(k, dest.shape[1])
            values, finite = self._rows([classes[i] for i in order.tolist()], scales[order], buf, slice(0, k))
            dest[where].index_copy_(0, host_device.to_device(order, dest.device), buf)
            return values[back], finite[back]
        plan = self._plan(classes, scales)
        k, total = len(classes), plan.grid.total
        rows = dest[where]
        if total == 0:
            rows.zero_()
            return torch.zeros(k, dtype=eng.row_dtype), torch.ones(k, dtype=torch.bool)
        # The run's one read from the device, once every layer's work is queued: its losses and
        # two flags (rows certainly finite, losses finite).
        losses, flags = host_device.read_back(*self._run(plan, rows))
        values = losses.to(eng.row_dtype)
        if not bool(flags[1]):
            eng.check_finite_loss(values, plan.classes)
        return values, torch.full((k,), bool(flags[0]), dtype=torch.bool)

    def _run(self, plan: RunPlan, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's forward, backward and layer sums into ``rows``: its losses ``[k]`` and flags
        ``[2]`` (rows certainly finite, losses finite), on the device and not read."""
        eng = self.engine
        x, y = eng.probe.batch(plan.indices, eng.device, eng.compute_dtype, memory_format=self.formats.gather)
        x = self.formats.apply(x)
        total = plan.grid.total
        seen = forward_capturing(
            eng.model,
            self.plan.holders,
            set(self.plan.units),
            x,
            lambda: eng.forward_context(0),
            self.copies,
            eng.io,
            total,
            self.expanded if self.expand else None,
        )
        if seen is None:  # an in-place change of a layer output refused: run again with copies
            return self._run(plan, rows)
        out, captured = seen
        if any(c.modified() for c in captured) and self.copies.widen(captured):
            return self._run(plan, rows)  # found before the backward: none wasted
        eng.stats.forwards += 1
        loss = eng.loss
        assert isinstance(loss, PartitionedLoss)  # the partitioned engine takes no other loss
        loss.check_outputs(out)
        dev_local = plan.grid.owner
        weighted, values = loss.run_losses(out, y, dev_local, plan.counts)
        values = values.detach()
        loss_finite = torch.isfinite(values).all()
        scales = plan.scales
        objective = weighted.sum() if scales is None else (weighted * scales.to(weighted.dtype)[dev_local]).sum()
        # A module run under no_grad has an output outside the graph: its parameters get no
        # gradient (None, like an unused one).
        targets = [t for c in captured for t in c.targets]
        found_grads = (
            torch.autograd.grad(objective, targets, allow_unused=True) if targets and objective.requires_grad else ()
        )
        found = {id(t): g for t, g in zip(targets, found_grads) if g is not None}
        eng.stats.backwards += 1
        if any(c.modified() for c in captured):
            if self.copies.widen(captured):  # copy those outputs (or all) and redo the run
                return self._run(plan, rows)
            raise RuntimeError("a hooked layer's input or output was modified in place")

        sink = ClassRows(rows, self.projections)
        live = self._live_tokens(captured, found)
        # By layer call, the class sums of the whole per-class gradients its rule formed on the
        # way: the step's gradient where they carry its weights (no inverse applied before).
        totals: dict[int, dict[str, torch.Tensor]] | None = None
        if eng.step is not None and (plan.inv is None or plan.inv_on_rows):
            totals = {id(c): {} for c in captured}
        for c in captured:
            if isinstance(c, Captured):
                kept = None if totals is None else totals[id(c)]
                self._rule_sums(c, found.get(id(c.output)), plan, sink, total, live.get(id(c)), totals=kept)
        for c in captured:
            if isinstance(c, UnitCall):
                self._unit_grads(c, found, plan, sink, total, totals=None if totals is None else totals[id(c)])
        sink.zero_unwritten(eng.layout.slots)  # no path to the loss in this run
        if plan.inv is not None and plan.inv_on_rows:
            sink.scale_rows(plan.inv)
        if eng.step is not None:  # each run's part of the step's objective: their sum is the step's
            part = self._step_gradient(captured, found, plan, live, totals or {})
            eng.step.grads = part if eng.step.grads is None else eng.step.grads.add_(part)
        return values, torch.stack([sink.certainly_finite(), loss_finite])

    def _step_gradient(
        self,
        captured: list,
        found: dict[int, torch.Tensor],
        plan: RunPlan,
        live: dict[int, torch.Tensor],
        totals: dict[int, dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """``[D]`` (the full layout's columns): the gradient of the run's objective itself, the
        step's (``engine.step``): the same rules over the same captures with the run's samples as
        one class, their output gradients as the weighted objective left them (no ``inv``), into
        whole columns (the rows may be projected). What the backward that stops at the layers'
        outputs does not form; for a Linear layer one ``G^T X``, as autograd's own would be. A
        layer call whose per-class gradients were formed whole (``totals``: their sums over the
        classes, by kind) gives those sums instead."""
        eng = self.engine
        full = getattr(eng, "full_layout", eng.layout)  # a projected engine's rows are its work row
        if self._full_layers is None or self._full_layers.keys() != self.plan.layers.keys():  # new, or lifted
            by_name = {s.name: s for s in full.slots}
            self._full_layers = {
                m: {kind: by_name[s.name] for kind, s in slots.items()} for m, slots in self.plan.layers.items()
            }
        total = plan.grid.total
        grid = ClassGrid.build((total,), plan.grid.dtype, plan.grid.owner.device)
        whole = RunPlan(plan.classes[:1], plan.counts.new_tensor([total]), plan.indices, grid, None, None)
        row = torch.empty(1, full.dim, dtype=eng.row_dtype, device=eng.device)
        sink = ClassRows(row)
        for kind_of_call in (Captured, UnitCall):
            for c in captured:
                if not isinstance(c, kind_of_call):
                    continue
                layers, kept = self._full_layers[c.module], totals.get(id(c), {})
                if kept and all(kind in kept for kind in layers):
                    out = sink.for_layer(layers)
                    for kind in layers:
                        out.put(kind, kept[kind].unsqueeze(0))
                elif isinstance(c, Captured):
                    self._rule_sums(c, found.get(id(c.output)), whole, sink, total, live.get(id(c)), self._full_layers)
                else:
                    self._unit_grads(c, found, whole, sink, total, self._full_layers)
        sink.zero_unwritten(full.slots)
        return row[0]

    def _live_tokens(self, captured: list, found: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """On the CPU's routes, for every layer call whose rule reads ``seen.live``: its live
        tokens (host bool), all read at once (``token_liveness``); ``{}`` elsewhere (a GPU pads)."""
        picked = []
        for c in captured:
            g = found.get(id(c.output)) if isinstance(c, Captured) else None
            if g is not None and g.ndim >= 3 and cpu_routes(g.device) and self.plan.rules[c.module].live_tokens:
                picked.append((c, g))
        if not picked:
            return {}
        masks = host_device.read_back(*(token_liveness(g) for _, g in picked))
        return {id(c): mask != 0 for (c, _), mask in zip(picked, masks)}

    def _rule_sums(
        self,
        c: Captured,
        g: torch.Tensor | None,
        plan: RunPlan,
        sink: ClassRows,
        total: int,
        live: torch.Tensor | None,
        layers: dict[nn.Module, dict[str, ParamSlot]] | None = None,
        totals: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """One call of a layer with a rule: its per-class sums into the rows (at ``layers``'
        columns: default the plan's); ``totals``: see ``LayerCapture``."""
        if g is None:
            return
        if c.inputs.shape[0] != total or g.shape[0] != total:
            raise NotLocal(c.module, f"{type(c.module).__name__} sees no per-sample dimension")
        grid = plan.grid
        if plan.inv is not None and not plan.inv_on_rows:
            g = g.to(grid.dtype) * plan.inv[grid.owner].view(-1, *[1] * (g.ndim - 1))
        self.plan.rules[c.module].sums(
            c.module,
            LayerCapture(c.inputs.detach(), g, grid, live, totals),
            sink.for_layer((layers or self.plan.layers)[c.module]),
        )

    def _unit_grads(
        self,
        c: UnitCall,
        found: dict[int, torch.Tensor],
        plan: RunPlan,
        sink: ClassRows,
        total: int,
        layers: dict[nn.Module, dict[str, ParamSlot]] | None = None,
        totals: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """One call of a module-VJP unit: a VJP of the module alone, per class, into the rows (at
        ``layers``' columns: default the plan's); ``totals``, when given, gets their class sums."""
        eng, grid = self.engine, plan.grid
        inv = None if plan.inv_on_rows else plan.inv
        mine = {id(t): found[id(t)] for t in c.targets if id(t) in found}
        if not mine:
            return
        if any(batch_dim(g, total, c.module) is None for g in mine.values()):
            raise NotLocal(c.module, f"an output of {type(c.module).__name__} has no per-sample dimension")
        slots = (layers or self.plan.layers)[c.module]
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), (c.args, c.kwargs))
        low = eng.precision.dtype != "fp32"
        with eng.precision.autocast(eng.device), NormInFloat32() if low else contextlib.nullcontext():
            # Compared: the outputs the loss depends on.
            outputs = pytree.tree_unflatten([t if t is not None and id(t) in mine else None for t in c.outputs], c.spec)
            if not check_layout(c.module, args, kwargs, outputs, total):
                raise NotLocal(c.module, f"{type(c.module).__name__} alone on one sample gives other outputs")
            grads = self.plan.units[c.module](c.module, args, kwargs, c.grad_outputs(mine), grid, tuple(slots))
        out = sink.for_layer(slots, full=True)
        values = {}
        for name, value in grads.items():
            value = value.to(grid.dtype)
            if inv is not None:
                value = value * inv.view(-1, *[1] * (value.ndim - 1))
            out.bound_by_values(value)
            values[name] = value
            if totals is not None:
                totals[name] = value.sum(dim=0)
        out.put_all(values)

    def check(self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice) -> None:
        """Once per model (see ``choices.HOOKS_CHECKED``): two rows from hooks against the plain
        single-class path; raises when they differ."""
        eng = self.engine
        nonempty = [i for i, c in enumerate(classes) if int(eng.counts[c]) > 0]
        if not nonempty:
            return
        picks = sorted({nonempty[0], nonempty[-1]})
        got = dest[where][picks]
        if not bool(torch.isfinite(got).all()):
            return  # an fp16 overflow: check on a later run
        want = torch.empty_like(got)
        for j, i in enumerate(picks):
            self.single(classes[i], scales[i : i + 1], want, slice(j, j + 1))
        tol = 1e-4 if eng.precision.dtype == "fp32" else 5e-2
        err = float((got - want).abs().max())
        if err > tol * max(float(want.abs().max()), 1e-30):
            raise RuntimeError(f"per-class sums from hooks differ from the plain gradient by {err:.3g}")
        self.checked = True
        choices.HOOKS_CHECKED.setdefault(eng.model, set()).add(self._check_key())

    def _check_key(self) -> tuple:
        """What the check vouches for: the selected parameters, precision, device, and the rules."""
        eng = self.engine
        return (
            tuple(s.name for s in eng.layout.slots),
            eng.precision.dtype,
            eng.device.type,
            frozenset(self.plan.rules.values()),
            frozenset((type(m), fn) for m, fn in self.plan.units.items()),
        )
