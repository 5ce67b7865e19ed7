"""The partitioned engine: each row from a forward+backward over only its own class's samples.

For class-partitioned losses (L_c depends only on the samples labelled c) on a model that treats
samples independently, row c is the gradient of the loss over class c's samples alone, so the
whole matrix costs about one forward+backward over the probe set.

To keep the hardware busy when classes are small, several classes are packed into one batch:
their samples are laid out as ``[K classes, m samples]`` (short classes padded with weight-0
copies of their own first sample, which add exactly zero) and ``torch.func.vmap(grad(...))``
over the class axis returns K separate gradients from one batched pass. Classes larger than a
batch are done alone, micro-batch by micro-batch. If vmap cannot handle a model, every class is
done alone (same rows, slower). Packing groups classes of similar size to limit padding, then
puts the rows back in the order asked for.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from service.errors import ClassgradError, InputError
from workers.amp import rows_with_rescale
from workers.engines.base import (
    GradientEngine,
    RowBlock,
    couples_samples,
    samples_independent,
    tree_map_tensors,
)
from workers.engines.dense import ROW_BYTES_BUDGET

log = logging.getLogger(__name__)


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


class _NormInFloat32(TorchFunctionMode):
    """Runs batch norm on half-precision inputs in float32 and casts the result back.

    Under vmap, autocast hands batch norm a half input with float32 statistics, which the CPU
    kernel rejects; outside vmap the kernel computes in float32 internally anyway, so this
    gives the same numbers while letting vmap batch BatchNorm models in fp16/bf16.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.batch_norm or func is torch.batch_norm) and args[0].dtype in (torch.float16, torch.bfloat16):
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


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
        self._use_vmap = True
        self._vmapped = None

    # --- one class alone -----------------------------------------------------------------------

    def _single(self, c: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.by_class[c]
        n = len(idx)
        row = torch.zeros(self.layout.dim, dtype=torch.promote_types(self.compute_dtype, torch.float32),
                          device=self.device)
        value = torch.zeros((), dtype=row.dtype, device=self.device)
        for chunk in idx.split(self.probe.batch_size):
            x, y = self.probe.batch(chunk, self.device, self.compute_dtype)
            with self.forward_context(0):
                out = self.model(x)
            self.stats.forwards += 1
            self.loss.check_outputs(out)
            part = self.loss.sample_losses(out, self.loss.labels(y)).sum() / n
            self.check_finite_loss(part.detach().reshape(1), torch.tensor([c]))
            grads = torch.autograd.grad(part * scale, self.params, allow_unused=True)
            self.stats.backwards += 1
            row += self.grads_to_rows(grads, batch_dims=0) / scale
            value += part.detach()
        return row, value

    # --- several classes in one vmapped pass ---------------------------------------------------

    def _build_vmapped(self):
        from torch.func import functional_call, grad, vmap

        model, loss, precision, device = self.model, self.loss, self.precision, self.device
        low_precision = precision.dtype != "fp32"

        def class_loss(params, x, y, w, s):
            with precision.autocast(device), (_NormInFloat32() if low_precision else contextlib.nullcontext()):
                out = functional_call(model, params, (x,))
            loss.check_outputs(out)
            value = (loss.sample_losses(out, loss.labels(y)) * w).sum()
            return value * s, value

        return vmap(grad(class_loss, has_aux=True), in_dims=(None, 0, 0, 0, 0))

    def _pack(self, classes: list[int], scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._vmapped is None:
            self._vmapped = self._build_vmapped()
        idx = [self.by_class[c] for c in classes]
        width = max(len(i) for i in idx)
        padded = torch.stack([torch.cat([i, i[:1].expand(width - len(i))]) for i in idx])
        weights = torch.stack([
            torch.cat([torch.full((len(i),), 1.0 / len(i)), torch.zeros(width - len(i))]) for i in idx
        ]).to(self.device, self.compute_dtype)
        x, y = self.probe.batch(padded.reshape(-1), self.device, self.compute_dtype)
        k = len(classes)
        x, y = tree_map_tensors(lambda t: t.reshape(k, width, *t.shape[1:]), (x, y))
        params = {s.name: p.detach() for s, p in zip(self.layout.slots, self.params)}
        grads, values = self._vmapped(params, x, y, weights, scales.to(self.compute_dtype))
        self.stats.forwards += 1
        self.stats.backwards += 1
        self.check_finite_loss(values.detach(), torch.tensor(classes))
        rows = self.grads_to_rows([grads[s.name] for s in self.layout.slots], batch_dims=1)
        return rows / scales.to(rows.dtype).unsqueeze(1), values.detach()

    def _pack_or_singles(self, classes: list[int], scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._use_vmap and len(classes) > 1:
            try:
                return self._pack(classes, scales)
            except ClassgradError:
                raise
            except Exception as exc:  # noqa: BLE001 - any vmap limitation: fall back, same rows
                self._use_vmap = False
                msg = f"vmap cannot batch this model ({type(exc).__name__}: {exc}); classes done one at a time"
                log.warning(msg)
                self.stats.notes.append(msg)
        pairs = [self._single(c, float(s)) for c, s in zip(classes, scales.tolist())]
        return torch.stack([r for r, _ in pairs]), torch.stack([v for _, v in pairs])

    # --- public --------------------------------------------------------------------------------

    def iter_blocks(self, classes: Sequence[int]) -> Iterator[RowBlock]:
        ids = self._check_classes(classes)
        group = min(self.group_rows, max(1, ROW_BYTES_BUDGET // (4 * self.layout.dim)))
        with self.selected_grads():
            for g0 in range(0, len(ids), group):
                yield self._group(ids[g0 : g0 + group])

    def _group(self, ids: torch.Tensor) -> RowBlock:
        n = len(ids)
        dtype = torch.promote_types(self.compute_dtype, torch.float32)
        rows = torch.zeros(n, self.layout.dim, dtype=dtype, device=self.device)
        values = torch.zeros(n, dtype=dtype)
        scales = torch.ones(n)
        again = torch.zeros(n, dtype=torch.bool)
        sizes = self.counts[ids]
        max_rows = self.block_rows or len(ids)
        packs, singles = plan_packs(sizes, self.probe.batch_size, max_rows)
        for positions in packs + [[p] for p in singles]:
            classes = ids[positions].tolist()
            found: dict[int, torch.Tensor] = {}

            def compute(which: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
                sub = [classes[i] for i in which.tolist()]
                r, v = self._pack_or_singles(sub, sc)
                for i, val in zip(which.tolist(), v):
                    found[i] = val
                return r

            r, s, a = rows_with_rescale(compute, len(classes), self.precision, torch.tensor(classes), self.device)
            pos = torch.tensor(positions)
            rows[pos.to(self.device)] = r
            values[pos] = torch.stack([found[i] for i in range(len(classes))]).cpu().to(dtype)
            scales[pos] = s.cpu()
            again[pos] = a.cpu()
        self.stats.rows += n
        self.stats.recomputed_rows += int(again.sum())
        return RowBlock(classes=ids, rows=rows, loss=values.float(), count=sizes.clone(),
                        loss_scale=scales, recomputed=again)
