"""The partitioned engine with Kronecker-projected rows: every row is projected inside the backward.

Holds ``KroneckerEngine``, a ``PartitionedEngine`` whose rows are ``projection.dim`` wide: the hook
path writes each Kronecker layer's projected part (``layer_rules.kronecker_sums``) and every other
selected parameter whole into a "work" row (units, then the rest), and each finished block's rest
is kept, projected densely or sketched with sparse signs
(``classgrad.workers.kronecker.KroneckerMap``). No full row is formed, except the two rows of the
hook path's one-off spot check (computed whole by the plain single-class path and projected with
the same factors).

Only the hook path projects inside the backward. A job whose rows would come from elsewhere (a
dense loss, a model that couples samples, a hook path that fails) is refused with one line that
points to ``projection.structure: dense``: never a silent detour through full rows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from classgrad.service.errors import ConfigError, first_line
from classgrad.workers.engines.base import RowBlock
from classgrad.workers.engines.partitioned.engine import PartitionedEngine
from classgrad.workers.kronecker import MEASURE_CLASSES, KroneckerMap
from classgrad.workers.layout import ParamLayout

log = logging.getLogger(__name__)

REST_ROWS = 256  # rows gathered per dense projection of the rest
REST_BYTES = 256 << 20  # at most this much of rest columns held for it

REFUSAL = "projection.structure=kronecker projects inside the partitioned engine's hook path"


class KroneckerEngine(PartitionedEngine):
    """Rows of ``dim`` columns: Kronecker layers projected in the backward, the rest kept or dense.

    ``projection``: ``dim``, ``kind``, ``seed``, ``rest`` (keep|dense|sketch), ``sketch_nonzeros``
    (rest: sketch), ``allocation`` (norm|size),
    ``low_rank`` (dense|kronecker), ``dense_layers`` (module name patterns left to the rest) and
    optionally ``record`` (a store's ``projection`` attribute: its split is reused, so every
    worker of a job projects the same way).
    """

    def __init__(self, *args: Any, projection: dict[str, Any], **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self._hooked is None:
            raise ConfigError(
                f"{REFUSAL}, which this model does not take (a selected parameter is outside the layer "
                "rules, shared, or hooked): use projection.structure=dense"
            )
        self.full_layout = self.layout
        hooked = self._hooked
        names = {m: n for n, m in self.model.named_modules()}
        modules = dict(self.model.named_modules())
        covered = {names[m] for m in hooked.plan.layers}
        record = projection.get("record")
        options: dict[str, Any] = {
            "dim": int(projection["dim"]),
            "kind": projection.get("kind", "rademacher"),
            "seed": int(projection.get("seed", 0)),
            "rest_mode": projection.get("rest", "dense"),
            "allocation": projection.get("allocation", "norm"),
            "dense_layers": tuple(projection.get("dense_layers", ())),
            "sketch_nonzeros": int(projection.get("sketch_nonzeros", 4)),
        }
        if record is not None:  # the layers the driver left to the rest, low-rank ones included
            options["dense_layers"] = tuple(record.get("dense_layers") or ())
        low_rank = projection.get("low_rank", "dense")
        kmap = KroneckerMap.plan(self.full_layout.slots, modules, covered, fixed=record, low_rank=low_rank, **options)
        self._install(kmap)
        if record is None and kmap.units:
            # The first block of classes, projected with the split by size: the layers whose
            # gradient reaches one token per sample (low_rank: dense) and every part's squared
            # norm (allocation: norm).
            first = list(range(min(MEASURE_CLASSES, self.loss.num_classes)))
            work = RowBlock.concat(list(super().iter_blocks(first))).rows
            self.stats.rows = 0  # the measurement is not part of the rows asked for
            measured = kmap.measure(work)
            is_low = [low_rank == "dense" and u.positions is not None and u.positions <= 1 for u in kmap.units]
            if any(is_low):
                positions = {u.weight.name: u.positions for u in kmap.units}
                low_names = tuple(u.weight.name.rpartition(".")[0] for u, flag in zip(kmap.units, is_low) if flag)
                options["dense_layers"] = (*options["dense_layers"], *low_names)
                moved = sum(m for m, flag in zip(measured, is_low) if flag)
                measured = [m for m, flag in zip(measured, is_low) if not flag] + [measured[-1] + moved]
                kmap = KroneckerMap.plan(self.full_layout.slots, modules, covered, low_rank=low_rank, **options)
                for u in kmap.units:
                    u.positions = positions[u.weight.name]
            if options["allocation"] == "norm":
                kmap = kmap.remeasured(measured)
            self._install(kmap)
        log.info(
            "kronecker projection: %d layers in %d columns, rest %s (%d parameters) in %d",
            len(self.kmap.units),
            self.kmap.units_width,
            self.kmap.rest_mode,
            self.kmap.rest_size,
            self.kmap.dim - self.kmap.units_width,
        )

    def _install(self, kmap: KroneckerMap) -> None:
        """Point the hook path at ``kmap``'s work row."""
        assert self._hooked is not None
        self.kmap = kmap
        work = kmap.work_slots()
        self.layout = ParamLayout(work)
        by_name = {s.name: s for s in work}
        plan = self._hooked.plan
        layers = {m: {kind: by_name[s.name] for kind, s in slots.items()} for m, slots in plan.layers.items()}
        self._hooked.plan = dataclasses.replace(plan, layers=layers)
        self._hooked.projections = {u.weight.name: u for u in kmap.units}
        self._hooked.single = self._single_projected
        self._vmap = None  # vmap forms full rows: never taken here

    @property
    def stored_dim(self) -> int:
        return self.kmap.dim

    def describe(self) -> dict[str, Any]:
        return self.kmap.describe()

    def _fallback(self, what: str, exc: Exception) -> None:
        raise ConfigError(
            f"{REFUSAL}, which failed here ({what}: {first_line(exc, with_type=True, limit=120)}): "
            "use projection.structure=dense"
        ) from exc

    def _single_projected(
        self, c: int, scale: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Class ``c``'s work row by the plain path (a full row, projected): the spot check only."""
        full = torch.empty(1, self.full_layout.dim, dtype=self.row_dtype, device=self.device)
        work, self.layout = self.layout, self.full_layout
        try:
            value, finite = PartitionedEngine._single(self, c, scale, full, slice(0, 1))
        finally:
            self.layout = work
        dest[where] = self.kmap.work_rows(full).to(dest.dtype)
        return value, finite

    def iter_blocks(self, classes: Sequence[int], out: torch.Tensor | None = None) -> Iterator[RowBlock]:
        """Stored rows. A projected rest is projected over gathered blocks (up to ``REST_ROWS`` rows
        or ``REST_BYTES`` of rest columns): generating a dense rest's random matrix costs the same
        for 16 rows as for 256 (a sketch's fixed cost per call is smaller: a few small kernels per
        chunk of coordinates), and the engine's groups of wide work rows are small. (``out`` is not
        taken: the work rows are wider than the stored ones.)"""
        if out is not None:
            raise ValueError("a KroneckerEngine's blocks are formed from work rows: out is not supported")
        if self.kmap.rest_projector is None:
            for block in super().iter_blocks(classes):
                yield dataclasses.replace(block, rows=self.kmap.stored_rows(block.rows))
            return
        gather = max(1, min(REST_ROWS, REST_BYTES // (4 * self.kmap.rest_size)))
        pending: list[RowBlock] = []
        for block in super().iter_blocks(classes):
            pending.append(block)
            if sum(len(b) for b in pending) >= gather:
                merged = RowBlock.concat(pending)
                pending = []
                yield dataclasses.replace(merged, rows=self.kmap.stored_rows(merged.rows))
        if pending:
            merged = RowBlock.concat(pending)
            yield dataclasses.replace(merged, rows=self.kmap.stored_rows(merged.rows))
