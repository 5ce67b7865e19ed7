"""The dense engine: rows as vector-Jacobian products with one-hot cotangents.

For losses where every sample touches every L_c (``logit``, ``bce``, a user's callable, or any
loss through BatchNorm in train mode). Per micro-batch the model runs forward once; then blocks
of rows are VJPs of that micro-batch's contribution to L with one-hot cotangents
(``torch.func.vmap`` over ``torch.func.vjp``; ``torch.autograd.grad(..., is_grads_batched=True)``
for models that cannot run under ``torch.func``; one ``torch.autograd.grad`` per row when the
block size is 1), all on the one graph, which is released after the last block. Rows over
several micro-batches are summed.

Memory: with one micro-batch, blocks stream out as they are computed (one block of rows alive).
With several, a group of at most ``group_rows`` rows (fewer if ``D`` is large) is accumulated
while every micro-batch passes once; so memory is bounded by the group, never by C. A block is
also capped so that the batched backward's gradient of the model outputs (block x micro-batch x
C floats, ``VJP_BYTES_BUDGET``) does not grow with C either.

The block size, when not given, is chosen from a short measurement on the first blocks: sizes
1, 2, 4, ... are timed per row on real rows (nothing is computed twice) and the smallest size
within 5% of the fastest is kept (once per process, per model and micro-batch shape).
Rows are written straight into their block (or group) buffer, and checked for inf/NaN with one
read (a row sum); only a row that may be non-finite goes through the exact per-row check.

Shortcuts through the model's final ``nn.Linear`` (``classgrad.workers.engines.head``, which lists the
conditions), tried in this order:
1. a loss linear in the outputs (``logit``) with fewer input features F than classes: a basis
   of F VJPs per micro-batch replaces the C per-row ones and rows are a matrix product; the
   basis is built in one pass over the probe set and kept for later calls until a parameter
   changes;
2. a loss whose L_c sees output column c only (``bce``; ``logit`` where 1 does not apply): the
   graph stops at the head's input (``HeadGraph``) and each row's VJP starts there, so no row
   pays for the backward of the loss and the head;
3. otherwise VJPs through the whole model, as above.
The engine notes which path it took and why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

import torch

from classgrad.errors import ClassgradError
from classgrad.workers.amp import rows_with_rescale
from classgrad.workers.engines import choices
from classgrad.workers.engines.base import GradientEngine, NormInFloat32, RowBlock, choice_clock, parameters_kept
from classgrad.workers.engines.head import (
    HeadBasis,
    HeadGraph,
    HeadSplit,
    NoHeadPath,
    head_basis,
    head_graph,
    parameter_versions,
)

log = logging.getLogger(__name__)

BLOCK_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
# Bytes of gradient rows (one block, or one accumulated group) an engine may hold at once.
ROW_BYTES_BUDGET = 1 << 30
# Bytes the batched backward of one block may hold for the gradient of the model outputs
# (block x micro-batch x C floats): with many classes this, not the rows, is what grows with
# C, so it caps the block size (memory stays flat in C).
VJP_BYTES_BUDGET = 256 << 20
# Times each block size is tried while measuring (the best counts). Two were not enough on a
# busy machine: a benchmark run once kept block size 4 for a CNN whose batched VJPs are
# slower per row than single ones. A size clearly slower after two tries is not tried again.
MEASURE_TRIALS = 3
# A measured block size smaller than this streams its rows in chunks of about this many.
STREAM_ROWS = 32
# Measured block sizes and the reasons rows cannot go through the head are kept per process in
# ``classgrad.workers.engines.choices`` (``BLOCK_ROWS``, ``NO_HEAD``): an actor measures once, not
# once per shard.


def _one_hot(values: torch.Tensor, classes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Cotangents ``[k, C]``: row i is ``scales[i]`` at ``classes[i]``, zero elsewhere."""
    cot = torch.zeros(len(classes), values.shape[0], dtype=values.dtype, device=values.device)
    cot[torch.arange(len(classes), device=values.device), classes] = scales.to(values.dtype)
    return cot


# Every graph below answers ``batched(classes, scales)`` (gradients with a leading row axis) and
# ``single(c, scale)`` (one row): the VJPs of L_c at loss scale ``scale``, in row order.


class _AutogradGraph:
    """One micro-batch's L contribution with its autograd graph; VJPs by ``torch.autograd.grad``
    (batched: ``is_grads_batched``). Works for every model, including BatchNorm in train mode."""

    def __init__(self, contrib: torch.Tensor, params: Sequence[torch.Tensor]):
        self.contrib, self.params = contrib, list(params)
        self.values = contrib.detach()

    def batched(self, classes: torch.Tensor, scales: torch.Tensor) -> Sequence[torch.Tensor | None]:
        return torch.autograd.grad(
            self.contrib,
            self.params,
            grad_outputs=_one_hot(self.values, classes, scales),
            is_grads_batched=True,
            retain_graph=True,
            allow_unused=True,
        )

    def single(self, c: torch.Tensor, scale: torch.Tensor) -> Sequence[torch.Tensor | None]:
        cot = _one_hot(self.values, c.view(1), scale.view(1))[0]
        return torch.autograd.grad(self.contrib, self.params, grad_outputs=cot, retain_graph=True, allow_unused=True)


class _FuncGraph:
    """The same from ``torch.func.vjp``; batched VJPs by ``torch.func.vmap`` over the cotangents,
    whose batching rules are faster than ``is_grads_batched`` (1.4x on the benchmark MLP)."""

    def __init__(self, values: torch.Tensor, vjp_fn, names: Sequence[str]):
        self.values, self.vjp_fn, self.names = values, vjp_fn, list(names)
        self._vmapped: Callable[..., Any] | None = None

    def _ordered(self, grads: dict) -> list[torch.Tensor | None]:
        return [grads.get(n) for n in self.names]

    def batched(self, classes: torch.Tensor, scales: torch.Tensor) -> Sequence[torch.Tensor | None]:
        if self._vmapped is None:
            from torch.func import vmap

            self._vmapped = vmap(self.vjp_fn)
        return self._ordered(self._vmapped(_one_hot(self.values, classes, scales))[0])

    def single(self, c: torch.Tensor, scale: torch.Tensor) -> Sequence[torch.Tensor | None]:
        return self._ordered(self.vjp_fn(_one_hot(self.values, c.view(1), scale.view(1))[0])[0])


class DenseEngine(GradientEngine):
    """One forward per micro-batch, then batched VJPs for blocks of rows on that graph."""

    name = "dense"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._batched_vjp = True  # falls back to a loop of single VJPs if vmap cannot batch the model
        self._use_func = True  # torch.func.vjp; falls back to autograd graphs if the model cannot run under it
        # A low-precision train-mode forward (dropout) may build a torch.func graph whose backward fails.
        self._check_func_backward = self.precision.dtype != "fp32" and self.model.training
        # Every L_k is checked, not only the rows asked for: one non-finite L_k poisons every
        # VJP on the shared graph (0 * NaN = NaN), and the error should name its class.
        self._all_classes = torch.arange(self.loss.num_classes)
        self._block_rows_given = self.block_rows is not None
        self._samples = min(self.probe.batch_size, len(self.probe))  # rows of the current micro-batch
        self._head: HeadBasis | None = None  # kept for later calls (an actor's next shard) while valid
        # per-row graphs from the head: not tried (None) / the split / abandoned (False)
        self._head_split: HeadSplit | None | Literal[False] = None

    # --- one block of VJPs --------------------------------------------------------------------

    def _graph(self, mb) -> _AutogradGraph | _FuncGraph | HeadGraph:
        """Forward one micro-batch, keeping what its VJPs need.

        For a ``per_column`` loss (``logit``, ``bce``) on a model that ends in an ``nn.Linear``,
        the graph stops at that layer's input (``HeadGraph``): each row's backward skips the
        loss and the head. Otherwise, with one row per VJP (a block size of 1, given or
        measured earlier) the graph is a plain autograd one: torch.func's strength is batching
        rows under vmap, and for single rows its per-call overhead made them 2-5% slower on the
        benchmark CNN."""
        if self._head_split is not False:
            graph = self._head_graph(mb)
            if graph is not None:
                self._known_block_rows()
                return graph
        self._known_block_rows()
        if self._use_func and self.block_rows != 1:
            try:
                func_graph = self._func_graph(mb)
                if self._check_func_backward:
                    # torch.func's VJP of scaled_dot_product_attention with dropout (train mode)
                    # under CPU autocast fails in its backward ("expected scalar type BFloat16 but
                    # found Float"; plain autograd does not): one row's VJP tried once, off the books.
                    func_graph.single(self._all_classes[0].to(self.device), torch.ones((), device=self.device))
                    self._check_func_backward = False
                return func_graph
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. BatchNorm in train mode updates buffers in place
                self._use_func = False
                msg = f"torch.func.vjp unavailable for this model ({type(exc).__name__}: {exc}); using autograd"
                log.info(msg)
                self.stats.notes.append(msg)
        _, contrib = self.forward(mb)
        return _AutogradGraph(contrib, self.params)

    def _head_graph(self, mb) -> HeadGraph | None:
        """Micro-batch ``mb``'s graph up to the head's input, or None (noted once) when that
        path does not apply; then every later micro-batch takes the whole model."""
        reason = self._no_head("graph")
        if reason is None:
            assert self._head_split is not False  # the caller skips the head once it is abandoned
            try:
                graph, split = head_graph(self, mb, self._head_split)
            except NoHeadPath as exc:
                reason = self._no_head("graph", exc)
            else:
                if self._head_split is None:
                    self._note(
                        "dense: each row's backward starts at the input of the final Linear layer "
                        "(the loss and the head are not differentiated per row)"
                    )
                self._head_split = split
                return graph
        self._head_split = False
        self._note(f"dense: VJPs through the whole model ({reason})")
        return None

    def _no_head(self, path: str, found: NoHeadPath | None = None) -> str | None:
        """Why rows cannot take a head ``path`` (``basis`` or ``graph``) for this model and job,
        as found earlier in this process; with ``found``, remember it (when it is lasting)."""
        key = (
            path,
            self.loss.name,
            self.loss.num_classes,
            tuple(self.layout.names),
            self.precision.dtype,
            str(self.device),
        )
        known = choices.NO_HEAD.setdefault(self.model, {})
        if found is not None and found.lasting:
            known[key] = str(found)
        return str(found) if found is not None else known.get(key)

    def _note(self, msg: str) -> None:
        """A note on how rows are computed, once per engine (not once per shard)."""
        if msg not in self.stats.notes:
            log.info(msg)
            self.stats.notes.append(msg)

    def _func_graph(self, mb) -> _FuncGraph:
        from torch.func import vjp

        x, y = self.probe.batch(mb.indices, self.device, self.compute_dtype)
        names = [s.name for s in self.layout.slots]
        params = {n: p.detach() for n, p in zip(names, self.params)}

        def contribution(p):
            outputs = self.io.functional(p, x)
            self.loss.check_outputs(outputs)
            return self.loss.batch_losses(outputs, y, self.norm)

        # Half-precision batch norm: computed in float32, or its backward cannot be vmapped.
        norm = NormInFloat32() if self.precision.dtype != "fp32" else contextlib.nullcontext()
        with parameters_kept(self.model), self.forward_context(mb.index), norm:
            # torch.func.vjp's annotation covers has_aux=True too (three values); here it returns two.
            values, vjp_fn = cast("tuple[torch.Tensor, Callable[..., Any]]", vjp(contribution, params))
        self.stats.forwards += 1
        return _FuncGraph(values.detach(), vjp_fn, names)

    def _vjp_rows(
        self,
        graph,
        classes: torch.Tensor,
        scales: torch.Tensor,
        out: torch.Tensor | None = None,
        unit_scale: bool = False,
    ) -> torch.Tensor:
        """Rows ``d contrib[classes[k]] / d params``, computed at loss scale ``scales[k]`` and
        unscaled; written into ``out`` when given (no temporary row buffer)."""
        grads = None
        if self._batched_vjp and len(classes) > 1:
            try:
                grads = graph.batched(classes, scales)
                self.stats.backwards += 1
            except RuntimeError as exc:
                self._batched_vjp = False
                msg = f"batched VJP unavailable for this model ({exc}); computing rows one at a time"
                log.warning(msg)
                self.stats.notes.append(msg)
        if grads is None:
            per_row = []
            for k in range(len(classes)):
                per_row.append(graph.single(classes[k], scales[k]))
                self.stats.backwards += 1
            if len(per_row) == 1:  # one row: a batch of one is a view, no stacking
                grads = [None if g is None else g.unsqueeze(0) for g in per_row[0]]
            else:
                grads = [
                    None
                    if all(g[i] is None for g in per_row)
                    else torch.stack([g[i] if g[i] is not None else torch.zeros_like(p) for g in per_row])
                    for i, p in enumerate(self.params)
                ]
        rows = self.layout.flatten(grads, batch_dims=1, out=out)
        if not unit_scale and bool((scales != 1).any()):
            rows.div_(scales.to(rows.dtype).unsqueeze(1))
        return rows

    def _rows_for(self, graph, classes: torch.Tensor, out: torch.Tensor | None = None):
        """Rows for ``classes`` (device tensor) from one graph, overflowed rows recomputed.

        The common case costs one read of the rows: a row whose sum is finite has only finite
        entries (an inf or NaN entry always makes the sum inf or NaN); only when some sum is not
        finite do the rows go through the exact per-row check and recomputation."""
        k = len(classes)
        first = torch.full((k,), self.precision.first_scale, dtype=torch.float32, device=self.device)
        rows = self._vjp_rows(graph, classes, first, out=out, unit_scale=self.precision.first_scale == 1)
        if bool(torch.isfinite(rows.sum(dim=1)).all()):
            return rows, first, torch.zeros(k, dtype=torch.bool, device=self.device)
        pending = [rows]  # the first call of rows_with_rescale asks for exactly these

        def compute(which: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            return pending.pop() if pending else self._vjp_rows(graph, classes[which], scales)

        return rows_with_rescale(compute, k, self.precision, classes.cpu(), self.device)

    # --- block size ----------------------------------------------------------------------------

    def _row_limit(self) -> int:
        return max(1, ROW_BYTES_BUDGET // (4 * self.layout.dim))

    def _vjp_limit(self, samples: int) -> int:
        """Most rows per batched VJP whose output gradient (``[rows, samples, C]``) fits the budget."""
        return max(1, VJP_BYTES_BUDGET // (4 * max(1, samples) * self.loss.num_classes))

    def _block_key(self) -> tuple:
        """What the best block size depends on: the model, the micro-batch, the rows, the device,
        and the kind of graph (from the head, torch.func, or autograd)."""
        kind = "head" if isinstance(self._head_split, HeadSplit) else "func" if self._use_func else "autograd"
        return (
            id(self.model),
            self.loss.num_classes,
            kind,
            self.probe.batch_size,
            len(self.probe),
            self.layout.dim,
            str(self.device),
            self.precision.dtype,
            self.loss.name,
            torch.get_num_threads(),
        )

    def _known_block_rows(self) -> None:
        """Take the block size measured earlier in this process for this model, if any."""
        if self.block_rows is None:
            self.block_rows = choices.BLOCK_ROWS.get(self._block_key())
            if self.block_rows is not None:
                self.stats.notes.append(f"dense block_rows={self.block_rows} (measured earlier in this process)")

    def _blocks(self, graph, classes: torch.Tensor, out: torch.Tensor | None = None):
        """``(slice, (rows, scales, again))`` for consecutive blocks covering ``classes``.

        Without a block size (none given, none measured yet in this process for this model and
        micro-batch), it is chosen on the way: one untimed warm-up row (the first call pays
        one-off costs), then blocks of 1, 1, 1, 2, 2, 2, 4, ... rows, each size timed up to
        ``MEASURE_TRIALS`` times (the best time counts: machines are noisy), stopping once a
        size is, after two tries, 1.5x slower per row than the best so far; the smallest size
        within 5% of the fastest is kept for the rest of this call, later calls and other
        engines on the same model. The measured blocks are real rows, never recomputed.
        With ``out`` (``[len(classes), D]``), rows are written into it.
        """
        n, pos = len(classes), 0

        def block(size: int):
            nonlocal pos
            sl = slice(pos, pos + size)
            result = self._rows_for(graph, classes[sl], out=None if out is None else out[sl])
            pos += size
            return sl, result

        self._known_block_rows()
        if self.block_rows is None:
            key = self._block_key()
            clock = choice_clock(self.device)
            limit = min(n, self._row_limit(), self._vjp_limit(self._samples))
            candidates = [b for b in BLOCK_CANDIDATES if b <= limit] or [1]
            timings: dict[int, float] = {}
            tries: dict[int, int] = {}
            for size in [0] + [b for b in candidates for _ in range(MEASURE_TRIALS)]:  # 0: the warm-up row
                if pos + max(size, 1) > n:
                    break
                t0 = clock()
                sl, result = block(max(size, 1))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = clock() - t0
                yield sl, result
                if size == 0:
                    continue
                tries[size] = tries.get(size, 0) + 1
                timings[size] = min(timings.get(size, float("inf")), elapsed / size)
                if tries[size] >= 2 and timings[size] > 1.5 * min(timings.values()):
                    break  # past the sweet spot; larger blocks only cost memory
            if timings:
                # The smallest size within 5% of the best: on a noisy machine a big block can
                # look a little faster by chance, and smaller blocks hold less memory.
                best = min(timings.values())
                self.block_rows = choices.BLOCK_ROWS[key] = min(b for b, t in timings.items() if t <= 1.05 * best)
                per_row = {b: f"{t * 1e3:.2f}ms" for b, t in timings.items()}
                note = f"dense block_rows={self.block_rows} chosen from per-row times {per_row}"
                log.info(note)
                self.stats.notes.append(note)
        while pos < n:
            yield block(min(self.block_rows or n, n - pos))

    # --- public --------------------------------------------------------------------------------

    def iter_blocks(self, classes: Sequence[int]) -> Iterator[RowBlock]:
        ids = self._check_classes(classes)
        if len(ids) == 0:
            return
        yield from self.computed(self._row_blocks(ids))

    def _row_blocks(self, ids: torch.Tensor) -> Iterator[RowBlock]:
        head = self._head_basis()
        if head is not None:
            yield from self._through_head(head, ids)
        elif self.probe.num_micro_batches == 1:
            yield from self._stream(ids)
        else:
            group = min(self.group_rows, self._row_limit())
            for g0 in range(0, len(ids), group):
                yield from self._accumulate(ids[g0 : g0 + group])

    def _head_basis(self) -> HeadBasis | None:
        """The basis for rows through the model's final Linear layer (``classgrad.workers.engines.head``),
        or None (with a note saying why) when that path does not apply."""
        if self._head is not None and self._head.versions == parameter_versions(self.model):
            return self._head
        self._head = None
        reason = self._no_head("basis")
        if reason is None:
            try:
                self._head = head_basis(self, ROW_BYTES_BUDGET)
            except NoHeadPath as exc:
                reason = self._no_head("basis", exc)
        if reason is not None:
            self._note(f"dense: one VJP per row ({reason})")
            return None
        assert self._head is not None  # no reason: head_basis returned it
        self._note(
            f"dense: rows through the final Linear layer ({self._head.split.head.in_features} VJPs per "
            f"micro-batch instead of one per class)"
        )
        return self._head

    def _through_head(self, head: HeadBasis, ids: torch.Tensor) -> Iterator[RowBlock]:
        """Rows as ``W[classes] @ R`` plus the head's own columns, a group at a time."""
        dev_ids = ids.to(self.device)
        group = min(self.group_rows, self._row_limit())
        for g0 in range(0, len(ids), group):
            sub = dev_ids[g0 : g0 + group]
            rows = head.rows(sub, self.row_dtype)
            yield self._block(
                ids[g0 : g0 + group],
                rows,
                head.losses[sub],
                torch.ones(len(sub)),
                torch.zeros(len(sub), dtype=torch.bool),
            )

    def _stream(self, ids: torch.Tensor) -> Iterator[RowBlock]:
        """One micro-batch: one forward, then every block on its graph, yielded as computed.

        A block size given by the caller is the size of the blocks yielded. A measured one
        (often 1 to 8 rows on a CPU) only sets how many rows each VJP computes: after the
        measurement, those VJPs write into chunks of at least ``STREAM_ROWS`` rows that are
        yielded whole, so the per-block bookkeeping (and the writer's) is not paid per row.
        """
        mb = next(self.probe.micro_batches())
        self._samples = len(mb.indices)
        graph = self._graph(mb)
        dev_ids = ids.to(self.device)
        self.check_finite_loss(graph.values, self._all_classes)
        values = graph.values
        n, pos = len(ids), 0
        if self.block_rows is None:
            blocks = self._blocks(graph, dev_ids)
            for sl, (rows, scales, again) in blocks:
                yield self._block(ids[sl], rows, values[dev_ids[sl]], scales, again)
                pos = sl.stop
                if self.block_rows is not None:  # measured (or found measured): chunk the rest
                    break
            blocks.close()
        b = self.block_rows or max(1, n - pos)
        chunk = b if self._block_rows_given else max(b, min(STREAM_ROWS, self._row_limit()) // b * b)
        for c0 in range(pos, n, chunk):
            sub = dev_ids[c0 : c0 + chunk]
            buf = torch.empty(len(sub), self.layout.dim, dtype=self.row_dtype, device=self.device)
            parts = [(scales, again) for _, (_, scales, again) in self._blocks(graph, sub, out=buf)]
            yield self._block(
                ids[c0 : c0 + len(sub)],
                buf,
                values[sub],
                torch.cat([p[0] for p in parts]),
                torch.cat([p[1] for p in parts]),
            )
        del graph  # the graph goes with its last reference

    def _accumulate(self, ids: torch.Tensor) -> Iterator[RowBlock]:
        """Several micro-batches: every micro-batch passes once, its rows added into the group
        (the first micro-batch writes its rows in place)."""
        dev_ids = ids.to(self.device)
        acc = torch.empty(len(ids), self.layout.dim, dtype=self.row_dtype, device=self.device)
        values = torch.zeros(len(ids), dtype=acc.dtype, device=self.device)
        min_scale = torch.full((len(ids),), float("inf"), device=self.device)
        again = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        self._samples = min(self.probe.batch_size, len(self.probe))
        for i, mb in enumerate(self.probe.micro_batches()):
            graph = self._graph(mb)
            self.check_finite_loss(graph.values, self._all_classes)
            values += graph.values[dev_ids]
            for sl, (rows, scales, redo) in self._blocks(graph, dev_ids, out=acc if i == 0 else None):
                if i:
                    acc[sl] += rows
                min_scale[sl] = torch.minimum(min_scale[sl], scales)
                again[sl] |= redo
            del graph
        yield self._block(ids, acc, values, min_scale, again)

    def _block(self, ids, rows, values, scales, again) -> RowBlock:
        self.stats.rows += len(ids)
        self.stats.recomputed_rows += int(again.sum())
        return RowBlock(
            classes=ids,
            rows=rows,
            loss=values.detach().float().cpu(),
            count=self.counts[ids],
            loss_scale=scales.float().cpu(),
            recomputed=again.cpu(),
        )
