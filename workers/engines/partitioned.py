"""The partitioned engine: each row from a forward+backward over only its own class's samples.

For class-partitioned losses (L_c depends only on the samples labelled c) on a model that treats
samples independently, row c is the gradient of the loss over class c's samples alone, so the
whole matrix costs about one forward+backward over the probe set.

To keep the hardware busy when classes are small, several classes are packed into one batch and
their gradients split apart again, in one of two ways:

- **Per-class sums from hooks** (when every selected parameter is the weight or bias of a plain
  ``nn.Linear``, ``nn.Conv2d`` or eval-mode ``nn.BatchNorm1d/2d``, as in a ResNet): a run of
  consecutive classes goes through one ordinary forward and one backward that stops at the
  outputs of those layers; a class's weight gradient is the sum over its samples of
  ``grad_output x input``, one batched matmul (Linear) or one grouped convolution backward
  (Conv2d) per layer, written straight into the row buffer (BatchNorm: sums of
  ``grad_output`` and ``grad_output x normalised input`` per class and channel). No
  padding in the forward, no per-sample gradients, no extra copy of the rows. Inside its own
  forward each hooked layer sees detached copies of its selected parameters, so every run can
  check in the autograd graph that nothing else uses them (``x @ layer.weight`` elsewhere in
  the model would escape the hooks); the first run on a model (per process) is also checked
  against the plain single-class path. Either failure abandons the hooks for vmap.
- **vmap** (any other model): samples laid out as ``[K classes, m samples]`` (short classes
  padded with weight-0 copies of their own samples, which add exactly zero) and
  ``torch.func.vmap(grad(...))`` over the class axis; packing groups classes of similar size to
  limit padding.

Classes larger than half a batch are done alone, micro-batch by micro-batch. If neither packing
way can handle a model, every class is done alone (same rows, slower). Rows always come back in
the order asked for, a group at a time; a group's buffer is kept small enough (``GROUP_BYTES``)
for the C allocator to recycle it instead of mapping fresh, page-faulting memory each time.

Speed choices that never change a row are measured once per process on the real runs (with the
thread's CPU clock on a single-threaded CPU, so other processes do not skew them): the memory
format of image inputs (channels-last is much faster for many CPU convolutions) and the layout
of each grouped convolution.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from typing import Iterator, Sequence

import torch
from torch import nn

from classgrad.service.errors import ClassgradError, InputError
from classgrad.workers.amp import rows_with_rescale
from classgrad.workers.engines.base import (
    GradientEngine,
    NormInFloat32,
    choice_clock,
    RowBlock,
    couples_samples,
    parameters_kept,
    reaches_any,
    samples_independent,
)
from classgrad.workers.engines.dense import ROW_BYTES_BUDGET
from classgrad.workers.probe import tree_map_tensors

log = logging.getLogger(__name__)

# Rows of one group are written into one new buffer. Up to about this size the C allocator
# recycles freed buffers; bigger ones are mapped fresh from the OS each time, whose first write
# (page faults, zeroing by the kernel) was once measured several times slower than the write
# itself (not reproduced since: benchmarks/diagnostics.py --sections page-faults). Harmless either way.
GROUP_BYTES = 32 << 20

# Speed choices measured once per process; they never change a row, only how fast it comes.
# Memory format of image inputs on the hook path, per (model, sample shape, dtype, device, precision):
_INPUT_FORMAT: dict[tuple, str] = {}
# Memory layout of each Conv2d's grouped weight-gradient computation, per shape:
_CONV_LAYOUT: dict[tuple, str] = {}
# Runs timed before the input format is settled: one warm-up, then four of each format,
# alternating (real runs: the only cost is doing some of them in the slower format). Trials
# are kept per process, so engines built one after another share them.
_FORMAT_TRIALS = 9
_FORMAT_TIMES: dict[tuple, list[list]] = {}  # [format, seconds per sample] per run
# Layers whose weight and bias gradients the hook path splits by class (BatchNorm in eval mode).
_HOOKED_TYPES = (nn.Linear, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d)
# Models whose per-class sums from hooks passed the check against the plain single-class path
# in this process, per (selected parameters, precision, device): the check is of the model's
# structure, so later engines on the same model object (an estimate after a job, repeated
# ``per_class_gradients`` calls) skip it. Weak keys: an entry goes with its model.
_HOOKS_CHECKED: "weakref.WeakKeyDictionary[nn.Module, set[tuple]]" = weakref.WeakKeyDictionary()


def plan_packs(sizes: torch.Tensor, batch_size: int, max_rows: int) -> tuple[list[list[int]], list[int]]:
    """Split positions ``0..len(sizes)`` into packs and single classes.

    A pack holds classes of similar size whose padded footprint ``K * max(size)`` fits in
    ``batch_size``; classes bigger than half a batch go alone (packing would not help).
    Empty classes go nowhere. Returns ``(packs, singles)``.
    """
    packs: list[list[int]] = []
    singles: list[int] = []
    current: list[int] = []
    for pos in torch.argsort(sizes, stable=True).tolist():
        n = int(sizes[pos])
        if n == 0:
            continue
        if 2 * n > batch_size:
            singles.append(pos)
            continue
        # Sizes ascend, so the new class sets the padded width of the pack.
        if current and ((len(current) + 1) * n > batch_size or len(current) >= max_rows):
            packs.append(current)
            current = []
        current.append(pos)
    if current:
        packs.append(current)
    return packs, singles


def plan_runs(sizes: torch.Tensor, batch_size: int, max_rows: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Split positions ``0..len(sizes)`` into runs of consecutive positions and single classes.

    A run holds at most ``batch_size`` samples and ``max_rows`` classes, and its padded
    footprint ``K * max(size)`` (which only the per-class reduction pays) stays within two
    batches. Classes bigger than half a batch go alone. Empty classes ride along in runs (their
    rows come out zero). Returns ``(runs as (start, stop), singles)``.
    """
    runs: list[tuple[int, int]] = []
    singles: list[int] = []
    start, total, width = None, 0, 0
    for pos, n in enumerate(sizes.tolist()):
        if 2 * n > batch_size:
            if start is not None:
                runs.append((start, pos))
                start = None
            singles.append(pos)
            continue
        if start is not None:
            k = pos - start + 1
            if total + n > batch_size or k > max_rows or k * max(width, n) > 2 * batch_size:
                runs.append((start, pos))
                start = None
        if start is None:
            start, total, width = pos, 0, 0
        total += n
        width = max(width, n)
    if start is not None:
        runs.append((start, len(sizes)))
    return runs, singles


class _Hooked:
    """The Linear/Conv2d/BatchNorm layers that own the selected parameters, and which slot is which.

    ``plan`` returns None when any selected parameter is not the plain weight or bias of an
    ``nn.Linear``, an ``nn.Conv2d`` (zero padding, one group) or an eval-mode
    ``nn.BatchNorm1d/2d`` (running statistics) that the model calls as a module, or when a
    parameter is shared (tied) or the layer (or every module, through
    ``register_module_forward_hook``) already has forward hooks: then per-class sums from hooks
    would not be exact, and vmap is used.
    """

    def __init__(self, layers: dict[nn.Module, dict[str, object]]):
        self.layers = layers

    @classmethod
    def plan(cls, model: nn.Module, layout) -> "_Hooked | None":
        from torch.nn.modules import module as module_state

        if module_state._global_forward_hooks or module_state._global_forward_pre_hooks:
            return None  # hooks on every module (they may change a layer's input or output)
        modules = dict(model.named_modules())
        uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        layers: dict[nn.Module, dict[str, object]] = {}
        for slot in layout.slots:
            owner, _, kind = slot.name.rpartition(".")
            mod = modules.get(owner)
            if type(mod) not in _HOOKED_TYPES or kind not in ("weight", "bias"):
                return None
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and (mod.training or mod.running_var is None):
                return None  # batch statistics couple samples (the engine refuses them anyway)
            if uses[id(getattr(mod, kind))] != 1 or mod._forward_hooks or mod._forward_pre_hooks:
                return None
            if isinstance(mod, nn.Conv2d) and (
                mod.groups != 1 or mod.padding_mode != "zeros" or isinstance(mod.padding, str)
            ):
                return None
            layers.setdefault(mod, {})[kind] = slot
        return cls(layers)


def _class_norm_grads(module: nn.modules.batchnorm._BatchNorm, G: torch.Tensor, A: torch.Tensor,
                      want_w: bool, want_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-class weight and bias gradients ``[k, C]`` of an eval-mode BatchNorm from ``G``
    ``[k, m, C, ...]`` (gradient at its output) and ``A`` (its input, same shape). Its output is
    ``weight * x_hat + bias`` with ``x_hat`` from the running statistics, so a class's bias
    gradient is the sum of G over its samples and positions, and its weight gradient the same
    sum of ``G * x_hat``."""
    reduce = [1, *range(3, G.dim())]
    gb = G.sum(dim=reduce) if want_b else None
    gw = None
    if want_w:
        shape = (1, 1, G.shape[2]) + (1,) * (G.dim() - 3)
        mean = module.running_mean.to(G.dtype).view(shape)
        invstd = torch.rsqrt(module.running_var.to(G.dtype) + module.eps).view(shape)
        gw = (G * ((A - mean) * invstd)).sum(dim=reduce)
    return gw, gb


def _grouped_channels_last(t: torch.Tensor) -> torch.Tensor:
    """``[k, m, c, h, w]`` -> ``[m, k*c, h, w]`` (class k's channels as group k) in channels-last
    memory, in one copy: the grouped convolution backward is about twice as fast on a CPU in
    that layout as in NCHW, and faster than the plain one."""
    k, m, c, h, w = t.shape
    return t.permute(1, 3, 4, 0, 2).contiguous().view(m, h, w, k * c).permute(0, 3, 1, 2)


class PartitionedEngine(GradientEngine):
    """Forward+backward over each class's own samples; small classes packed and vmapped."""

    name = "partitioned"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.loss.partitioned:
            raise InputError(
                f"engine.kind=partitioned needs a class-partitioned loss (cross_entropy or a "
                f"@partitioned_loss callable); {self.loss.name!r} is dense: use engine.kind=dense or auto"
            )
        if not samples_independent(self.model):
            coupled = sorted({type(m).__name__ for m in self.model.modules() if couples_samples(m)})
            raise InputError(
                f"engine.kind=partitioned needs a model that treats samples independently; it has "
                f"{', '.join(coupled)} in train mode: use model.mode=eval, or engine.kind=dense or auto"
            )
        labels = self.loss.labels(self.probe.targets)
        self.by_class = self.probe.samples_by_class(labels, self.loss.num_classes)
        # The same index as one flat tensor: class c's samples are order[start[c] : start[c] + counts[c]],
        # so a pack's padded sample grid is gathered with one indexing op instead of a loop.
        self._order = torch.argsort(labels, stable=True)
        self._start = torch.cumsum(self.counts, 0) - self.counts
        self._use_vmap = True
        self._vmapped = None
        self._hooked = _Hooked.plan(self.model, self.layout)
        self._hooks_checked = self._hooks_key() in _HOOKS_CHECKED.get(self.model, ())
        self._hook_clone = False
        # Once channels-last inputs are chosen, batches are gathered that way (one pass, not two).
        self._gather_format: torch.memory_format | None = None

    # --- where rows go ---------------------------------------------------------------------------
    #
    # Rows are written straight into the group's output buffer (``dest``): at a run of
    # consecutive positions (a slice: a view, no copy) or at scattered positions (an index
    # tensor: one indexed copy per parameter). No per-pack row buffer is built and copied again.

    def _write(self, grads: Sequence[torch.Tensor | None], scales: torch.Tensor, dest: torch.Tensor,
               where: slice | torch.Tensor) -> torch.Tensor:
        """Write per-parameter gradients ``[k, *shape]`` (computed at loss scale ``scales``) as
        rows ``dest[where]``, divided by the scale; return whether each row is certainly finite.

        The check costs one read of the gradients: a row's sum is finite when all its entries
        are (an inf or NaN entry always makes it inf or NaN). A non-finite sum of finite entries
        (overflow of the sum) only sends the row to the exact check in ``rows_with_rescale``.
        """
        k = len(scales)
        if bool((scales != 1).any()):
            div = scales.to(self.device, self.row_dtype)
            grads = [None if g is None else g / div.view(k, *[1] * (g.ndim - 1)) for g in grads]
        total = None
        for g in grads:
            if g is not None:
                part = g.reshape(k, -1).sum(dim=1, dtype=self.row_dtype)
                total = part if total is None else total + part
        if isinstance(where, slice):
            self.layout.flatten(grads, batch_dims=1, out=dest[where])
        else:
            self.layout.flatten(grads, batch_dims=1, out=dest, index=where)
        assert total is not None
        return torch.isfinite(total)

    # --- one class alone -----------------------------------------------------------------------

    def _single(self, c: int, scale: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor):
        idx = self.by_class[c]
        n = len(idx)
        if n == 0:  # no samples: a zero row
            dest[where] = 0
            return torch.zeros(1, dtype=self.row_dtype, device=self.device), torch.ones(1, dtype=torch.bool)
        s = float(scale[0])
        acc: list[torch.Tensor | None] | None = None
        value = torch.zeros((), dtype=self.row_dtype, device=self.device)
        for chunk in idx.split(self.probe.batch_size):
            x, y = self.probe.batch(chunk, self.device, self.compute_dtype)
            with self.forward_context(0):
                out = self.model(x)
            self.stats.forwards += 1
            self.loss.check_outputs(out)
            part = self.loss.sample_losses(out, self.loss.labels(y)).sum() / n
            self.check_finite_loss(part.detach().reshape(1), torch.tensor([c]))
            grads = torch.autograd.grad(part * s, self.params, allow_unused=True)
            self.stats.backwards += 1
            if acc is None:
                acc = list(grads)
            else:  # a class bigger than a batch: its micro-batches add up
                acc = [a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
            value += part.detach()
        assert acc is not None
        finite = self._write([None if g is None else g.unsqueeze(0) for g in acc], scale, dest, where)
        return value.reshape(1), finite

    # --- several classes in one vmapped pass ---------------------------------------------------

    def _build_vmapped(self):
        from torch.func import functional_call, grad, vmap

        model, loss, precision, device = self.model, self.loss, self.precision, self.device
        low_precision = precision.dtype != "fp32"

        def class_loss(params, x, y, w, s):
            with precision.autocast(device), (NormInFloat32() if low_precision else contextlib.nullcontext()):
                out = functional_call(model, params, (x,))
            loss.check_outputs(out)
            value = (loss.sample_losses(out, loss.labels(y)) * w).sum()
            return value * s, value

        return vmap(grad(class_loss, has_aux=True), in_dims=(None, 0, 0, 0, 0))

    def _pack(self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor):
        if self._vmapped is None:
            self._vmapped = self._build_vmapped()
        cls = torch.tensor(classes)
        counts = self.counts[cls]
        k, width = len(classes), int(counts.max())
        if width == 0:  # only empty classes
            dest[where] = 0
            return torch.zeros(k, dtype=self.row_dtype, device=self.device), torch.ones(k, dtype=torch.bool)
        # [k, width] grid of sample indices; short classes repeat their own last sample with weight 0.
        j = torch.arange(width)
        take = self._start[cls].unsqueeze(1) + torch.minimum(j.unsqueeze(0), (counts - 1).unsqueeze(1))
        padded = self._order[take]
        weights = torch.where(j.unsqueeze(0) < counts.unsqueeze(1), 1.0 / counts.unsqueeze(1).double(), 0.0)
        weights = weights.to(self.device, self.compute_dtype)
        x, y = self.probe.batch(padded.reshape(-1), self.device, self.compute_dtype)
        x, y = tree_map_tensors(lambda t: t.reshape(k, width, *t.shape[1:]), (x, y))
        params = {s.name: p.detach() for s, p in zip(self.layout.slots, self.params)}
        with parameters_kept(self.model):
            grads, values = self._vmapped(params, x, y, weights, scales.to(self.device, self.compute_dtype))
        self.stats.forwards += 1
        self.stats.backwards += 1
        self.check_finite_loss(values.detach(), cls)
        finite = self._write([grads[s.name] for s in self.layout.slots], scales, dest, where)
        return values.detach(), finite

    # --- several classes from one ordinary pass, split by hooks -------------------------------

    def _hook_rows(self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor,
                   where: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` into ``dest[where]`` from one forward and one backward (see the
        module docstring); returns (losses, finite)."""
        assert self._hooked is not None
        layers = self._hooked.layers
        cls = torch.tensor(classes)
        counts = self.counts[cls]
        k, total = len(classes), int(counts.sum())
        rows = dest[where]
        if total == 0:
            rows.zero_()
            return torch.zeros(k, dtype=self.row_dtype, device=self.device), torch.ones(k, dtype=torch.bool)
        # The run's samples, class after class, with no padding.
        local = torch.repeat_interleave(torch.arange(k), counts)
        first = torch.cumsum(counts, 0) - counts
        within = torch.arange(total) - first[local]
        x, y = self.probe.batch(self._order[self._start[cls][local] + within], self.device, self.compute_dtype,
                                memory_format=self._gather_format)
        x, trying = self._input_format(x)
        clock = choice_clock(self.device)
        t_start = clock()

        captured: list[tuple[nn.Module, torch.Tensor, torch.Tensor, int, int]] = []
        clone = self._hook_clone
        # Inside its own forward a hooked layer sees detached copies of its selected parameters,
        # so the graph holds no edge from the layer to them: any edge left after the forward is
        # a use outside the layer (``x @ layer.weight``), which hooks would miss (checked below).
        real = {m: {kind: getattr(m, kind) for kind in slots} for m, slots in layers.items()}
        detached = {m: {kind: t.detach() for kind, t in kinds.items()} for m, kinds in real.items()}

        def swap_in(module, args):
            module._parameters.update(detached[module])

        def keep(module, args, output):
            module._parameters.update(real[module])
            # Nothing before it needs a gradient: start the graph here (unless the model runs
            # this layer under no_grad, where its parameters truly get no gradient).
            if not output.requires_grad and torch.is_grad_enabled():
                output.requires_grad_()
            captured.append((module, args[0], output, args[0]._version, output._version))
            # A model that changes a layer's output in place (ReLU(inplace=True)) gets a copy, so
            # the gradient is taken at the layer's own output.
            return output.clone() if clone else None

        handles = [m.register_forward_pre_hook(swap_in) for m in layers]
        handles += [m.register_forward_hook(keep) for m in layers]
        retry = False
        try:
            # parameters_kept: the real parameters are back even when the forward raised inside a layer.
            with parameters_kept(self.model), self.forward_context(0):
                out = self.model(x)
        except RuntimeError:
            # An in-place change of an output that starts the graph (a leaf) is refused by
            # autograd: run again with copied outputs, once.
            if clone:
                raise
            retry = True
        finally:
            for h in handles:
                h.remove()
        if retry:
            self._hook_clone = True
            return self._hook_rows(classes, scales, dest, where)
        if reaches_any(out.grad_fn, {id(t) for kinds in real.values() for t in kinds.values()}):
            raise RuntimeError("a selected parameter of a hooked layer is also used outside that layer's forward")
        self.stats.forwards += 1
        self.loss.check_outputs(out)
        per_sample = self.loss.sample_losses(out, self.loss.labels(y))
        dev_local = local.to(self.device)
        weights = (1.0 / counts.clamp(min=1).double()).to(self.device, per_sample.dtype)[dev_local]
        weighted = per_sample * weights
        values = torch.zeros(k, dtype=weighted.dtype, device=self.device).index_add_(0, dev_local, weighted.detach())
        self.check_finite_loss(values, cls)
        scaled = bool((scales != 1).any())
        objective = (weighted * scales.to(self.device, weighted.dtype)[dev_local]).sum() if scaled else weighted.sum()
        # A layer run under no_grad has an output outside the graph: its parameters get no
        # gradient (None, like an unused one).
        live = [i for i, (_, _, o, _, _) in enumerate(captured) if o.requires_grad]
        found = torch.autograd.grad(objective, [captured[i][2] for i in live], allow_unused=True) if live and objective.requires_grad else ()
        grads: list[torch.Tensor | None] = [None] * len(captured)
        for i, g in zip(live, found):
            grads[i] = g
        self.stats.backwards += 1
        if any(a._version != va or o._version != vo for _, a, o, va, vo in captured):
            if not self._hook_clone:  # once: switch to copied outputs and redo the run
                self._hook_clone = True
                return self._hook_rows(classes, scales, dest, where)
            raise RuntimeError("a hooked layer's input or output was modified in place")

        dtype = rows.dtype
        inv = (1.0 / scales.double()).to(self.device, dtype)[dev_local] if scaled else None
        width = int(counts.max())
        if bool((counts == width).all()):
            spots = None  # every class has `width` samples: [total] is already [k, width]
        else:
            spots = (dev_local * width + within.to(self.device))

        def padded(t: torch.Tensor) -> torch.Tensor:  # [total, ...] -> [k, width, ...], zero rows as padding
            t = t.to(dtype)
            if spots is None:
                return t.reshape(k, width, *t.shape[1:])
            grid = t.new_zeros(k * width, *t.shape[1:])
            return grid.index_copy_(0, spots, t).view(k, width, *t.shape[1:])

        written: set[str] = set()
        bounds: list[torch.Tensor] = []
        summed: list[torch.Tensor] = []

        def peak(t: torch.Tensor) -> torch.Tensor:  # max |t| in one pass, no temporary; NaN stays NaN
            lo, hi = torch.aminmax(t)
            return torch.maximum(-lo, hi)

        def put(slot, value: torch.Tensor) -> None:
            target = rows[:, slot.offset : slot.offset + slot.size]
            if slot.name in written:
                target.add_(value.reshape(k, slot.size))
            else:
                target.copy_(value.reshape(k, slot.size))
                written.add(slot.name)

        for (module, a, _, _, _), g in zip(captured, grads):
            if g is None:
                continue
            slots = self._hooked.layers[module]
            a = a.detach()
            if inv is not None:
                g = g.to(dtype) * inv.view(-1, *[1] * (g.ndim - 1))
            if isinstance(module, nn.Linear):
                G = padded(g.reshape(total, -1, g.shape[-1])).reshape(k, -1, g.shape[-1])
                terms = G.shape[1]
                if "weight" in slots:
                    A = padded(a.reshape(total, -1, a.shape[-1])).reshape(k, -1, a.shape[-1])
                    bounds.append(peak(G) * peak(A).clamp(min=1) * terms)
                    slot = slots["weight"]
                    if slot.name in written:
                        put(slot, torch.bmm(G.transpose(1, 2), A))
                    else:  # straight into the rows: no temporary, no copy
                        view = rows[:, slot.offset : slot.offset + slot.size].view(k, *module.weight.shape)
                        torch.bmm(G.transpose(1, 2), A, out=view)
                        written.add(slot.name)
                else:
                    bounds.append(peak(G) * terms)
                if "bias" in slots:
                    put(slots["bias"], G.sum(dim=1))
            else:  # Conv2d: one grouped convolution backward; BatchNorm: per-class sums
                is_norm = isinstance(module, nn.modules.batchnorm._BatchNorm)
                grads_of = _class_norm_grads if is_norm else self._class_conv_grads
                gw, gb = grads_of(module, padded(g), padded(a), "weight" in slots, "bias" in slots)
                # Checked by their sum (one read): finite only if every entry is. These are k
                # copies of a layer's parameters: small in a small CNN, 45M floats for a
                # ResNet-18 run of 4 classes, where an exact isfinite takes four passes.
                summed.extend(t.sum() for t in (gw, gb) if t is not None)
                if "weight" in slots:
                    put(slots["weight"], gw)
                if "bias" in slots:
                    put(slots["bias"], gb)
        for slot in self.layout.slots:
            if slot.name not in written:  # no path to the loss in this run
                rows[:, slot.offset : slot.offset + slot.size].zero_()
        # Finite inputs with |g| * |a| * terms far below the float range cannot give an inf or NaN
        # row: one cheap check on the layer tensors instead of a pass over the rows. Anything
        # else goes to the exact per-row check.
        checks = [(torch.stack(bounds) < 1e37).all()] if bounds else []
        checks += [torch.isfinite(torch.stack(summed)).all()] if summed else []
        ok = bool(torch.stack(checks).all()) if checks else True
        if trying is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            trying.append((clock() - t_start) / total)
        return values.detach(), torch.full((k,), ok, dtype=torch.bool)

    def _input_format(self, x):
        """Image inputs in the memory format that runs this model faster (channels-last is often
        much faster for convolutions and pooling on a CPU, or with tensor cores). Decided from the
        first runs themselves (real work, no extra passes). Returns ``(x, trial)``: ``trial`` is
        a list to append this run's seconds per sample to while the format is being measured."""
        if not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()):
            return x, None
        key = (id(self.model), tuple(x.shape[1:]), x.dtype, str(self.device), self.precision.dtype)
        fmt, trial = _INPUT_FORMAT.get(key), None
        if fmt is None:
            trials = _FORMAT_TIMES.setdefault(key, [])
            if len(trials) >= _FORMAT_TRIALS:
                best: dict[str, float] = {}
                for f, *t in trials[1:]:  # the first run pays one-off costs
                    best[f] = min([best.get(f, float("inf")), *t])
                fmt = _INPUT_FORMAT[key] = min(best, key=best.get)
                note = "partitioned: image inputs %s (seconds per sample: %s)" % (
                    fmt, {f: f"{t:.2e}" for f, t in best.items()})
                log.info(note)
                self.stats.notes.append(note)
            else:
                fmt = ("contiguous", "channels_last")[len(trials) % 2]
                trial = [fmt]
                trials.append(trial)
        if trial is None and fmt == "channels_last":
            self._gather_format = torch.channels_last
        if fmt == "channels_last":  # a no-op once batches are gathered channels-last
            x = x.contiguous(memory_format=torch.channels_last)
        return x, trial

    def _class_conv_grads(self, module: nn.Conv2d, G: torch.Tensor, A: torch.Tensor, want_w: bool, want_b: bool):
        """Per-class weight and bias gradients of a Conv2d from ``G`` ``[k, m, cout, ho, wo]``
        (gradient at its output) and ``A`` ``[k, m, cin, h, w]`` (its input): one convolution
        backward with the k classes as k groups.

        The memory layout matters on a CPU (channels-last can be twice as fast, or slower once
        its copy is paid): the first call for each layer times both and keeps the faster.
        """
        k, m, cout = G.shape[:3]
        # Only the weight's shape matters for its own gradient (the input's gradient is not
        # asked for), so a zero-stride stand-in of the grouped shape; a copy of the weight per
        # class (``repeat``) cost a ResNet-18 run 45M floats of writes with 4 classes.
        weight = G.new_zeros(()).expand(k * cout, *module.weight.shape[1:])

        def run(layout: str):
            if layout == "channels_last":
                gg, ag = _grouped_channels_last(G), _grouped_channels_last(A)
            else:
                gg = G.transpose(0, 1).reshape(m, k * cout, *G.shape[3:])
                ag = A.transpose(0, 1).reshape(m, k * A.shape[2], *A.shape[3:])
            _, gw, gb = torch.ops.aten.convolution_backward(
                gg, ag, weight, [k * cout], module.stride, module.padding, module.dilation, False, [0, 0],
                k, [False, want_w, want_b],
            )
            return gw, gb

        key = (module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
               module.dilation, tuple(G.shape), tuple(A.shape), G.dtype, str(G.device),
               G.is_contiguous(memory_format=torch.channels_last) if G.dim() == 4 else
               G[0].is_contiguous(memory_format=torch.channels_last))
        layout = _CONV_LAYOUT.get(key)
        if layout is None:
            clock = choice_clock(G.device)
            timings = {}
            for candidate in ("contiguous", "channels_last", "contiguous", "channels_last"):
                t0 = clock()
                result = run(candidate)
                if G.is_cuda:
                    torch.cuda.synchronize(G.device)
                timings[candidate] = min(timings.get(candidate, float("inf")), clock() - t0)
            layout = _CONV_LAYOUT[key] = min(timings, key=timings.get)
            return result if layout == "channels_last" else run(layout)
        return run(layout)

    def _check_hooks(self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice) -> None:
        """Once per model (see ``_HOOKS_CHECKED``): two rows from hooks against the plain
        single-class path."""
        nonempty = [i for i, c in enumerate(classes) if int(self.counts[c]) > 0]
        if not nonempty:
            return
        picks = sorted({nonempty[0], nonempty[-1]})
        got = dest[where][picks]
        if not bool(torch.isfinite(got).all()):
            return  # an fp16 overflow: check on a later run
        want = torch.empty_like(got)
        for j, i in enumerate(picks):
            self._single(classes[i], scales[i : i + 1], want, slice(j, j + 1))
        tol = 1e-4 if self.precision.dtype == "fp32" else 5e-2
        err = float((got - want).abs().max())
        if err > tol * max(float(want.abs().max()), 1e-30):
            raise RuntimeError(f"per-class sums from hooks differ from the plain gradient by {err:.3g}")
        self._hooks_checked = True
        _HOOKS_CHECKED.setdefault(self.model, set()).add(self._hooks_key())

    def _hooks_key(self) -> tuple:
        return (tuple(s.name for s in self.layout.slots), self.precision.dtype, self.device.type)

    def _rows_into(self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor,
                   where: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` at loss scales ``scales`` into ``dest[where]``: (losses, finite)."""
        if self._hooked is not None and isinstance(where, slice):
            try:
                result = self._hook_rows(classes, scales, dest, where)
                if not self._hooks_checked:
                    self._check_hooks(classes, scales, dest, where)
                return result
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - anything hooks cannot do exactly: vmap, same rows
                self._hooked = None
                msg = f"per-class sums from hooks unavailable ({type(exc).__name__}: {exc}); using vmap"
                log.warning(msg)
                self.stats.notes.append(msg)
        if self._use_vmap and len(classes) > 1:
            try:
                return self._pack(classes, scales, dest, where)
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - any vmap limitation: fall back, same rows
                self._use_vmap = False
                msg = f"vmap cannot batch this model ({type(exc).__name__}: {exc}); classes done one at a time"
                log.warning(msg)
                self.stats.notes.append(msg)
        if isinstance(where, slice):
            first = where.start or 0
            spots: list = [slice(first + i, first + i + 1) for i in range(len(classes))]
        else:
            spots = [where[i : i + 1] for i in range(len(classes))]
        pairs = [self._single(c, scales[i : i + 1], dest, spot) for i, (c, spot) in enumerate(zip(classes, spots))]
        return torch.cat([v for v, _ in pairs]), torch.cat([f for _, f in pairs])

    def _checked(self, classes: list[int], dest: torch.Tensor, where: slice | torch.Tensor):
        """Rows into ``dest[where]``, overflowed (fp16) rows recomputed: (losses, scales, recomputed)."""
        k = len(classes)
        first = torch.full((k,), self.precision.first_scale, dtype=torch.float32)
        values, finite = self._rows_into(classes, first, dest, where)
        if bool(finite.all()):  # the common case: no row needs a second look
            return values, first, torch.zeros(k, dtype=torch.bool)
        # Some row may be non-finite: hand the rows to the exact per-row check and recompute.
        found = dict(enumerate(values))
        pending = [dest[where]]

        def compute(which: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
            if pending:  # the first call asks for every row at the first scale: already computed
                return pending.pop()
            sub = [classes[i] for i in which.tolist()]
            buf = torch.empty(len(sub), self.layout.dim, dtype=self.row_dtype, device=self.device)
            vals, _ = self._rows_into(sub, sc.cpu(), buf, slice(0, len(sub)))
            for i, v in zip(which.tolist(), vals):
                found[i] = v
            return buf

        rows, scales, again = rows_with_rescale(compute, k, self.precision, torch.tensor(classes), self.device)
        dest[where] = rows
        return torch.stack([found[i] for i in range(k)]), scales.cpu(), again.cpu()

    # --- public --------------------------------------------------------------------------------

    def iter_blocks(self, classes: Sequence[int]) -> Iterator[RowBlock]:
        ids = self._check_classes(classes)
        row_bytes = 4 * self.layout.dim
        # A power of two (at least 16) so groups stay aligned with power-of-two store row chunks.
        small = 1 << max(4, (GROUP_BYTES // row_bytes).bit_length() - 1)
        group = min(self.group_rows, max(1, ROW_BYTES_BUDGET // row_bytes), small)
        with self.selected_grads():
            for g0 in range(0, len(ids), group):
                yield self._group(ids[g0 : g0 + group])

    def _group(self, ids: torch.Tensor) -> RowBlock:
        n = len(ids)
        dtype = self.row_dtype
        rows = torch.empty(n, self.layout.dim, dtype=dtype, device=self.device)
        values = torch.zeros(n, dtype=dtype)
        scales = torch.ones(n)
        again = torch.zeros(n, dtype=torch.bool)
        sizes = self.counts[ids]
        empty = (sizes == 0).nonzero().squeeze(1)
        if len(empty):
            rows[empty.to(self.device)] = 0  # a class without samples has a zero gradient
        max_rows = self.block_rows or len(ids)
        if self._hooked is not None:  # runs of consecutive classes: rows land in place
            runs, singles = plan_runs(sizes, self.probe.batch_size, max_rows)
            jobs = [list(range(a, b)) for a, b in runs]
        else:
            jobs, singles = plan_packs(sizes, self.probe.batch_size, max_rows)
        for positions in jobs + [[p] for p in singles]:
            classes = ids[positions].tolist()
            p0 = positions[0]
            if positions == list(range(p0, p0 + len(positions))):
                where: slice | torch.Tensor = slice(p0, p0 + len(positions))
            else:
                where = torch.tensor(positions, device=self.device)
            v, s, a = self._checked(classes, rows, where)
            pos = torch.tensor(positions)
            values[pos] = v.cpu().to(dtype)
            scales[pos] = s
            again[pos] = a
        self.stats.rows += n
        self.stats.recomputed_rows += int(again.sum())
        return RowBlock(classes=ids, rows=rows, loss=values.float(), count=sizes.clone(),
                        loss_scale=scales, recomputed=again)
