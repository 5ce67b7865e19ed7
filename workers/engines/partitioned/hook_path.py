"""The hook path: a run of consecutive classes from one forward and one backward, split by class.

Holds ``HookPlan`` (the layers that own the selected parameters and their layer rules, or None
when some parameter is outside every rule) and ``HookPath`` (a run's rows, and the one-off spot
check against the plain single-class path).

A run's samples go through one ordinary forward (``capture.forward_capturing``) and one backward
that stops at the outputs of the hooked layers; each layer's rule
(``classgrad.workers.engines.layer_rules``) turns its input and output gradient into per-class
gradients written straight into the row buffer. No padding in the forward, no per-sample
gradients, no extra copy of the rows. The first run on a model (per process, see
``choices.HOOKS_CHECKED``) is checked against the plain single-class path; any failure makes the
engine abandon the hooks for vmap (same rows).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as module_state  # where global forward hooks are kept

from classgrad.workers.engines import choices
from classgrad.workers.engines.base import GradientEngine, choice_clock
from classgrad.workers.engines.layer_rules import ClassGrid, ClassRows, LayerCapture, LayerRule, rule_for
from classgrad.workers.engines.partitioned.capture import forward_capturing
from classgrad.workers.engines.partitioned.input_format import ImageFormat
from classgrad.workers.engines.partitioned.packing import ClassSamples
from classgrad.workers.layout import ParamLayout, ParamSlot
from classgrad.workers.losses import PartitionedLoss

log = logging.getLogger(__name__)


class HookPlan:
    """The layers that own the selected parameters: which slot is which, and each layer's rule.

    ``plan`` returns None when any selected parameter is not one its layer's rule computes (no
    rule for the type, a rule that does not apply to the layer as configured, another parameter
    name), or when a parameter is shared (tied) or the layer (or every module, through
    ``register_module_forward_hook``) already has forward hooks: then per-class sums from hooks
    would not be exact, and vmap is used.
    """

    def __init__(self, layers: dict[nn.Module, dict[str, ParamSlot]], rules: dict[nn.Module, LayerRule]):
        self.layers = layers
        self.rules = rules

    @classmethod
    def plan(cls, model: nn.Module, layout: ParamLayout) -> HookPlan | None:
        if module_state._global_forward_hooks or module_state._global_forward_pre_hooks:
            return None  # hooks on every module (they may change a layer's input or output)
        modules = dict(model.named_modules())
        uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        layers: dict[nn.Module, dict[str, ParamSlot]] = {}
        rules: dict[nn.Module, LayerRule] = {}
        for slot in layout.slots:
            owner, _, kind = slot.name.rpartition(".")
            mod = modules.get(owner)
            if mod is None:
                return None
            rule = rule_for(mod)
            if rule is None or kind not in rule.kinds:
                return None
            if uses[id(getattr(mod, kind))] != 1 or mod._forward_hooks or mod._forward_pre_hooks:
                return None
            reason = rule.applies(mod)
            if reason is not None:
                log.debug("partitioned: no per-class sums from hooks for %s (%s)", owner or "the model", reason)
                return None
            layers.setdefault(mod, {})[kind] = slot
            rules[mod] = rule
        return cls(layers, rules)


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
        self.clone = False  # copy layer outputs (the model changes them in place)
        self.formats = ImageFormat(engine.model, engine.device, engine.precision.dtype, engine.stats)
        self.projections: dict = {}  # weight name -> Kronecker unit: rows projected inside the backward

    @property
    def layers(self) -> dict[nn.Module, dict[str, ParamSlot]]:
        return self.plan.layers

    def rows(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` at loss scales ``scales`` into ``dest[where]``: (losses, finite)."""
        eng = self.engine
        cls = torch.tensor(classes)
        counts = eng.counts[cls]
        k, total = len(classes), int(counts.sum())
        rows = dest[where]
        if total == 0:
            rows.zero_()
            return torch.zeros(k, dtype=eng.row_dtype, device=eng.device), torch.ones(k, dtype=torch.bool)
        # The run's samples, class after class, with no padding.
        indices, local, within = self.samples.consecutive(cls)
        x, y = eng.probe.batch(indices, eng.device, eng.compute_dtype, memory_format=self.formats.gather)
        x, trying = self.formats.apply(x)
        clock = choice_clock(eng.device)
        t_start = clock()

        kinds = {m: tuple(slots) for m, slots in self.plan.layers.items()}
        seen = forward_capturing(eng.model, kinds, x, lambda: eng.forward_context(0), self.clone)
        if seen is None:  # an in-place change of a layer output: run again with copies, once
            self.clone = True
            return self.rows(classes, scales, dest, where)
        out, captured = seen
        eng.stats.forwards += 1
        loss = eng.loss
        assert isinstance(loss, PartitionedLoss)  # the partitioned engine takes no other loss
        loss.check_outputs(out)
        per_sample = loss.sample_losses(out, loss.labels(y))
        dev_local = local.to(eng.device)
        weights = (1.0 / counts.clamp(min=1).double()).to(eng.device, per_sample.dtype)[dev_local]
        weighted = per_sample * weights
        values = torch.zeros(k, dtype=weighted.dtype, device=eng.device).index_add_(0, dev_local, weighted.detach())
        eng.check_finite_loss(values, cls)
        scaled = bool((scales != 1).any())
        objective = (weighted * scales.to(eng.device, weighted.dtype)[dev_local]).sum() if scaled else weighted.sum()
        # A layer run under no_grad has an output outside the graph: its parameters get no
        # gradient (None, like an unused one).
        live = [i for i, c in enumerate(captured) if c.output.requires_grad]
        found = (
            torch.autograd.grad(objective, [captured[i].output for i in live], allow_unused=True)
            if live and objective.requires_grad
            else ()
        )
        grads: list[torch.Tensor | None] = [None] * len(captured)
        for i, found_grad in zip(live, found):
            grads[i] = found_grad
        eng.stats.backwards += 1
        if any(c.modified() for c in captured):
            if not self.clone:  # once: switch to copied outputs and redo the run
                self.clone = True
                return self.rows(classes, scales, dest, where)
            raise RuntimeError("a hooked layer's input or output was modified in place")

        dtype = rows.dtype
        inv = (1.0 / scales.double()).to(eng.device, dtype)[dev_local] if scaled else None
        width = int(counts.max())
        # Every class has `width` samples: [total] is already [k, width].
        spots = None if bool((counts == width).all()) else dev_local * width + within.to(eng.device)
        grid = ClassGrid(k, width, spots, dtype)
        sink = ClassRows(rows, self.projections)
        for c, g in zip(captured, grads):
            if g is None:
                continue
            if inv is not None:
                g = g.to(dtype) * inv.view(-1, *[1] * (g.ndim - 1))
            self.plan.rules[c.module].sums(
                c.module, LayerCapture(c.inputs.detach(), g, grid), sink.for_layer(self.plan.layers[c.module])
            )
        sink.zero_unwritten(eng.layout.slots)  # no path to the loss in this run
        ok = sink.certainly_finite()
        if trying is not None:
            if eng.device.type == "cuda":
                torch.cuda.synchronize(eng.device)
            trying.append((clock() - t_start) / total)
        return values.detach(), torch.full((k,), ok, dtype=torch.bool)

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
        )
