"""The partitioned engine: each row from a forward+backward over only its own class's samples.

Holds ``PartitionedEngine``: the choice of path for each group of classes, the plain
single-class path, the checked loop (fp16 rows that overflowed are recomputed) and the row
groups. ``GROUP_BYTES`` sizes a group's buffer.

For class-partitioned losses (L_c depends only on the samples labelled c) on a model that treats
samples independently, row c is the gradient of the loss over class c's samples alone, so the
whole matrix costs about one forward+backward over the probe set. To keep the hardware busy when
classes are small, several classes go through one pass and are split apart again:

- **hooks** (``hook_path``): runs of consecutive classes (``packing.plan_runs``), rows written
  in place. Each selected parameter is handled by its layer's rule
  (``classgrad.workers.engines.layer_rules``: Linear, Conv2d, eval-mode BatchNorm, ...) or, for
  any other module, by a VJP of the module that holds it alone (``layer_rules.module_vjp``);
- **vmap** (``vmap_path``) when the hooks cannot be used: packs of classes of similar size
  (``packing.plan_packs``);
- **one forward per pack, a backward per class** (``loop_path``): the last resort, never slower
  than the per-class loop.

Classes larger than half a batch are done alone, micro-batch by micro-batch. If a fast path
fails for a model (anything it cannot do exactly), the engine falls back: hooks to vmap, vmap to
the loop (same rows, slower). Which path each parameter took, and why, is logged once per engine
in one short line (also in ``stats.notes``); each fallback is also said once on its own,
plainly, with how much slower its path is (a ``FALLBACK``-prefixed note, which the run summary
lists). Rows always come back in the order asked for, a group at a time. Speed choices measured
on the way live in ``choices``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from classgrad.errors import ClassgradError, InputError, first_line
from classgrad.workers.amp import rows_with_rescale
from classgrad.workers.engines import choices
from classgrad.workers.engines.base import (
    GradientEngine,
    RowBlock,
    couples_samples,
    draws_only,
    samples_independent,
    without_draws,
)
from classgrad.workers.engines.dense_engine import ROW_BYTES_BUDGET
from classgrad.workers.engines.partitioned.hook_path import HookPath, HookPlan
from classgrad.workers.engines.partitioned.loop_path import LoopPath
from classgrad.workers.engines.partitioned.packing import ClassSamples, plan_packs, plan_runs
from classgrad.workers.engines.partitioned.vmap_path import VmapPath
from classgrad.workers.losses import PartitionedLoss

log = logging.getLogger(__name__)

# Rows of one group are written into one new buffer (unless the caller gives one for all rows:
# then groups, and the runs of classes in them, are bounded only by ``group_rows``). Up to about
# this size the C allocator recycles freed buffers; bigger ones are mapped fresh from the OS each
# time, whose first write (page faults, zeroing by the kernel) was once measured several times
# slower than the write itself (not reproduced since: benchmarks/diagnostics.py --sections
# page-faults). Harmless either way.
GROUP_BYTES = 32 << 20
FALLBACK = "fallback: "  # the prefix of the notes that say a fallback (the run summary lists them apart)
# How much slower the path a fallback leads to is, as the notes say it: per-sample gradients by vmap
# cost about 2.5x the hooks' per-class sums (DESIGN.md: a small CNN, 128 classes, on a CPU); the
# loop pays one backward per class of a pack instead of one per pack.
VMAP_SLOWER = 2.5


class OneForwardRefused(InputError):
    """A training batch whose dropout draws come from the caller (``draws_from_caller``) needs
    every sample forwarded once, by the hook path; it could not take this batch (the message
    says why). The training routes then take their general route, for this model from then on
    (``draws_refused``)."""


NEEDS_HOOKS = "the batch's dropout draws need the hook path"


def draws_refused(model: nn.Module) -> bool:
    """Whether an engine with the caller's draws was refused on ``model`` (``choices.DRAWS_REFUSED``)."""
    return model in choices.DRAWS_REFUSED


def _refuse_draws(model: nn.Module, why: str) -> OneForwardRefused:
    """The refusal, recorded for ``model`` and said once."""
    choices.DRAWS_REFUSED[model] = why
    log.info("training: %s; this model's batches take the general route", why)
    return OneForwardRefused(why)


class PartitionedEngine(GradientEngine):
    """Forward+backward over each class's own samples; small classes split by hooks or vmap."""

    name = "partitioned"
    # A run's padded footprint (classes x the largest one) in batches: more runs of fewer classes
    # beyond it. A training step's rows (``workers.training``) take more, to keep one backward.
    padded_batches = 2
    # The constructor refuses any loss that is not ``partitioned``: the ``PartitionedLoss`` family.
    loss: PartitionedLoss

    def __init__(self, *args: Any, draws_from_caller: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not self.loss.partitioned:
            raise InputError(
                f"engine.kind=partitioned needs a class-partitioned loss (cross_entropy or a "
                f"@partitioned_loss callable); {self.loss.name!r} is dense: use engine.kind=dense or auto"
            )
        # A training batch (``workers.training``): dropout's masks drawn as the plain step draws
        # them, each sample forwarded once by the hook path (nothing recomputed: a second
        # forward would draw other masks), so each row is its class's gradient under the draws.
        # Any model in train mode, dropout layers or not: a layer may draw by its own mode.
        self.draws_from_caller = draws_from_caller
        if not samples_independent(self.model) and not (draws_from_caller and draws_only(self.model)):
            coupled = sorted({type(m).__name__ for m in self.model.modules() if couples_samples(m)})
            raise InputError(
                f"engine.kind=partitioned needs a model that treats samples independently; it has "
                f"{', '.join(coupled)} in train mode: use model.mode=eval, or engine.kind=dense or auto"
            )
        labels = self.loss.labels(self.probe.targets)
        samples = self.samples = ClassSamples.from_labels(labels, self.counts)
        self._vmap: VmapPath | None = VmapPath(self, samples, self._write)
        self._loop = LoopPath(self, samples, self._write)
        plan = HookPlan.plan(self.model, self.layout)
        self._hooked: HookPath | None = None if plan is None else HookPath(self, plan, samples, self._single)
        # Paths given up on, and why (in the path line); the paths already described.
        self._abandoned: list[str] = []
        self._described: set[str] = set()
        self._pack = 1  # classes in the pack at hand: a fallback to the loop costs a backward each
        if self.draws_from_caller:
            self._vmap = None  # both would forward a sample again: never taken with the caller's draws
            if plan is None:
                raise _refuse_draws(self.model, f"{NEEDS_HOOKS}, which this model does not take")
        if plan is None:
            self._abandoned.append("hooks abandoned (forward hooks on every module, or on the model)")
            self._say_fallback("hooks abandoned: forward hooks on every module, or on the model")

    # --- where rows go ---------------------------------------------------------------------------
    #
    # Rows are written straight into the group's output buffer (``dest``): at a run of
    # consecutive positions (a slice: a view, no copy) or at scattered positions (an index
    # tensor: one indexed copy per parameter). No per-pack row buffer is built and copied again.

    def _write(
        self,
        grads: Sequence[torch.Tensor | None],
        scales: torch.Tensor,
        dest: torch.Tensor,
        where: slice | torch.Tensor,
    ) -> torch.Tensor:
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

    def _single(
        self, c: int, scale: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row of class ``c`` at loss scale ``scale`` into ``dest[where]``: (loss, finite)."""
        idx = self.samples.of(c)
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
                out = self.io(x)
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

    # --- the choice of path --------------------------------------------------------------------

    def _fallback(self, what: str, exc: Exception) -> None:
        """Give up a path for this engine: why goes in the next path line (or its own short
        note when a path line was already written)."""
        why = f"{what} abandoned ({first_line(exc, with_type=True, limit=120)})"
        self._say_fallback(f"{what} abandoned: {first_line(exc, with_type=True, limit=120)}", what)
        if self._described:
            note = f"partitioned: {why}"
            log.warning(note)
            self.stats.notes.append(note)
        else:
            self._abandoned.append(why)

    def _say_fallback(self, what: str, path: str = "hooks") -> None:
        """Say a fallback once, plainly, with how much slower the path it leads to is."""
        if path == "hooks" and self._vmap is not None:
            slower = f"the vmap path, about {VMAP_SLOWER:g}x slower"
        else:
            slower = f"one backward per class (the loop path), up to {max(2, self._pack)}x slower"
        note = f"{FALLBACK}{what}; {slower}"
        log.warning(note)
        self.stats.notes.append(note)

    def _describe(self, path: str) -> None:
        """Once per path: one line saying which path the parameters took, and why."""
        if path in self._described:
            return
        self._described.add(path)
        n = len(self.layout.slots)
        if path == "hooks":
            assert self._hooked is not None
            what = self._hooked.summary()
        elif path == "vmap":
            what = f"vmap for all {n} params"
        else:
            what = f"one forward per pack of classes and a backward per class for all {n} params"
        line = f"partitioned: {what}" + "".join(f"; {why}" for why in self._abandoned)
        self._abandoned = []
        log.info(line)
        self.stats.notes.append(line)

    def _rows_into(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``classes`` at loss scales ``scales`` into ``dest[where]``: (losses, finite)."""
        self._pack = len(classes)
        if self._hooked is not None and isinstance(where, slice):
            try:
                return self._hook_rows(classes, scales, dest, where)
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - anything hooks cannot do exactly: vmap, same rows
                if self.draws_from_caller:  # no other path forwards each sample once
                    why = f"{NEEDS_HOOKS}, which failed here ({first_line(exc, with_type=True, limit=120)})"
                    raise _refuse_draws(self.model, why) from exc
                self._hooked = None
                self._fallback("hooks", exc)
        if self.draws_from_caller:
            raise _refuse_draws(self.model, f"{NEEDS_HOOKS} over the batch in one run")
        if self._vmap is not None and len(classes) > 1:
            try:
                result = self._vmap.rows(classes, scales, dest, where)
                self._describe("vmap")
                return result
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - any vmap limitation: fall back, same rows
                self._vmap = None
                self._fallback("vmap", exc)
        if len(classes) > 1:  # the last resort: one forward for the pack, a backward per class
            self._describe("loop")
            return self._loop.rows(classes, scales, dest, where)
        if isinstance(where, slice):
            first = where.start or 0
            spots: list = [slice(first + i, first + i + 1) for i in range(len(classes))]
        else:
            spots = [where[i : i + 1] for i in range(len(classes))]
        pairs = [self._single(c, scales[i : i + 1], dest, spot) for i, (c, spot) in enumerate(zip(classes, spots))]
        return torch.cat([v for v, _ in pairs]), torch.cat([f for _, f in pairs])

    def _hook_rows(
        self, classes: list[int], scales: torch.Tensor, dest: torch.Tensor, where: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hook path's rows, spot-checked once per model. With the caller's draws the check
        runs first, on two classes with the model in eval mode (its plain path forwards them
        again), the step's gradient set aside meanwhile; else after, on the rows themselves."""
        hooked = self._hooked
        assert hooked is not None
        if self.draws_from_caller and not hooked.checked:
            picks = sorted({0, len(classes) - 1})
            spare = torch.empty(len(picks), dest.shape[1], dtype=dest.dtype, device=dest.device)
            step, self.step = self.step, None
            try:
                with without_draws(self.model):
                    hooked.rows([classes[i] for i in picks], scales[picks], spare, slice(0, len(picks)))
                    hooked.check([classes[i] for i in picks], scales[picks], spare, slice(0, len(picks)))
            finally:
                self.step = step
        result = hooked.rows(classes, scales, dest, where)
        if not hooked.checked:
            hooked.check(classes, scales, dest, where)
        self._describe("hooks")
        if bool(result[1].all()):  # bounded by the run's rules (and, once, checked)
            self.stats.bounded_rows += len(classes)
        return result

    def _checked(
        self, classes: list[int], dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows into ``dest[where]``, overflowed (fp16) rows recomputed: (losses, scales, recomputed)."""
        k = len(classes)
        first = torch.full((k,), self.precision.first_scale, dtype=torch.float32)
        if self.step is not None:  # the step's class weights scale the losses; rows are unscaled
            first *= torch.tensor([self.step.weights[c] for c in classes], dtype=torch.float32)
        values, finite = self._rows_into(classes, first, dest, where)
        if bool(finite.all()):  # the common case: no row needs a second look
            return values, first, torch.zeros(k, dtype=torch.bool)
        # Some row may be non-finite: hand the rows to the exact per-row check and recompute.
        found = dict(enumerate(values))
        pending = [dest[where]]

        def compute(which: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
            if pending:  # the first call asks for every row at the first scale: already computed
                return pending.pop()
            if self.draws_from_caller:  # a recomputed row would be of other draws than the step's
                why = "fp16 rows that overflowed would be recomputed under other dropout draws"
                raise _refuse_draws(self.model, why)
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

    def iter_blocks(self, classes: Sequence[int], out: torch.Tensor | None = None) -> Iterator[RowBlock]:
        """Row blocks of ``classes``, in order. With ``out`` (``[len(classes), D]`` in the row dtype
        on the engine's device) each block's rows are written straight into it and are views of
        it, so a caller that wants every row in one tensor does not copy them again."""
        ids = self._check_classes(classes)
        if out is not None and (out.shape != (len(ids), self.layout.dim) or out.dtype != self.row_dtype):
            raise ValueError(
                f"out must be [{len(ids)}, {self.layout.dim}] {self.row_dtype}, got {out.shape} {out.dtype}"
            )
        row_bytes = 4 * self.layout.dim
        # A power of two (at least 16) so groups stay aligned with power-of-two store row chunks.
        small = 1 << max(4, (GROUP_BYTES // row_bytes).bit_length() - 1)
        group = min(self.group_rows, max(1, ROW_BYTES_BUDGET // row_bytes))
        if out is None:  # each group gets a new buffer: keep it small enough to be recycled
            group = min(group, small)
        yield from self.computed(
            self._group(ids[g0 : g0 + group], None if out is None else out[g0 : g0 + group])
            for g0 in range(0, len(ids), group)
        )

    def _group(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> RowBlock:
        n = len(ids)
        dtype = self.row_dtype
        if rows is None:
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
            runs, singles = plan_runs(sizes, self.probe.batch_size, max_rows, self.padded_batches)
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
        return RowBlock(
            classes=ids, rows=rows, loss=values.float(), count=sizes.clone(), loss_scale=scales, recomputed=again
        )
