"""The partitioned engine with rows projected inside the backward, whatever the structure.

Holds ``ProjectedEngine``, a ``PartitionedEngine`` whose rows are ``projection.dim`` wide: the hook
path writes each projected layer's part (the structure's layer sums, by the unit's structure) and
every other selected parameter whole into a "work" row (units, then the rest), and each finished
block's rest is projected into the stored row by the structure's map
(``classgrad.workers.projection``: ``KroneckerMap``, ``TensorSketchMap``). No full row is formed,
except the two rows of the hook path's one-off spot check (computed whole by the plain
single-class path and mapped the same way). The structure plans the map (``plan``, given by
``classgrad.workers.projection``: this package never imports a structure).

Only the hook path projects inside the backward. A job whose rows would come from elsewhere (a
dense loss, a model that couples samples, a hook path that fails) is refused with one line
(``refusal``); for the default structure, ``create_engine`` then takes a sketch of finished rows
instead and says so.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from classgrad.errors import ConfigError, first_line
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.base import RowBlock
from classgrad.workers.engines.layer_rules.rule_io import ProjectionUnit
from classgrad.workers.engines.partitioned.engine import PartitionedEngine
from classgrad.workers.layout import ParamLayout

log = logging.getLogger(__name__)

REST_ROWS = 256  # rows gathered per projection of the rest
REST_BYTES = 256 << 20  # at most this much of rest columns held for it


def refusal(structure: str) -> str:
    return f"projection.structure={structure} projects inside the partitioned engine's hook path"


class ProjectionRefused(ConfigError):
    """A structure that projects inside the backward cannot take this job, ``why`` (the default
    structure then falls back to a sketch of finished rows; a named one is refused)."""

    def __init__(self, why: str):
        self.why = why
        super().__init__(f"{why}: use projection.structure=dense")


class ProjectedMap(Protocol):
    """What the engine asks of a structure's map (``KroneckerMap``, ``TensorSketchMap``, a
    plugin's): its ``units`` (one per projected layer, each a ``layer_rules.ProjectionUnit``, the
    hook path's sums write them), the ``work_slots`` the hook path writes (the units' columns,
    then every other parameter whole: the rest), and the steps from work rows to stored rows."""

    @property
    def dim(self) -> int: ...  # stored columns
    @property
    def units(self) -> Sequence[ProjectionUnit]: ...
    @property
    def units_width(self) -> int: ...  # work columns of the units, first in a work row
    @property
    def rest_size(self) -> int: ...  # work columns of the rest, after the units
    @property
    def rest_projector(self) -> object | None: ...  # None: the rest is stored as it is (or there is none)

    def work_slots(self) -> list[ParamSlot]: ...

    def unit_rows(self, work: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows ``[n, dim]`` holding the units' part of work rows (``into``: written there)."""
        ...

    def add_rest(self, out: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """``out`` with the rest's columns ``rest`` ``[n, rest_size]`` projected and added in."""
        ...

    def work_rows(self, full: torch.Tensor) -> torch.Tensor:
        """Full rows ``[n, D]`` to work rows (the spot check's rows, formed whole)."""
        ...

    def project_full(self, full: torch.Tensor) -> torch.Tensor:
        """Full rows ``[n, D]`` to stored rows: the reference of the rows projected in the backward."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the store records of the map (its structure's ``plan`` reuses it on a resume)."""
        ...


# (draft map, classes) -> work rows of the job's first ``classes`` classes through it.
MeasureRows = Callable[[ProjectedMap, int], torch.Tensor]
# (engine, modules by name, names of the modules the hook path covers) -> the structure's map.
MapPlan = Callable[["ProjectedEngine", dict[str, nn.Module], set[str]], ProjectedMap]


class ProjectedEngine(PartitionedEngine):
    """Rows of ``dim`` columns, projected in the backward by a structure's map (``self.kmap``).

    ``plan``: the structure's plan of its map (``ProjectionStructure.plan`` with the job's
    options); ``structure``: its name (the store's record says it).
    """

    def __init__(self, *args: Any, plan: MapPlan, structure: str, **kwargs: Any):
        self.structure = structure  # before the engine's checks, whose refusals may name it
        super().__init__(*args, **kwargs)
        if self._hooked is None:
            raise ProjectionRefused(
                f"{refusal(self.structure)}, which this model does not take (a selected parameter is outside "
                "the layer rules, shared, or hooked)"
            )
        self.full_layout = self.layout
        names = {m: n for n, m in self.model.named_modules()}
        modules = dict(self.model.named_modules())
        covered = {names[m] for m in self._hooked.plan.layers}
        self._install(plan(self, modules, covered))

    def measure_rows(self, kmap: ProjectedMap, classes: int) -> torch.Tensor:
        """Work rows of the first ``classes`` classes (fewer in a smaller job) through ``kmap``: a
        plan measuring its first block (the Kronecker split); not counted as rows asked for."""
        self._install(kmap)
        first = range(min(classes, self.loss.num_classes))
        rows = RowBlock.concat(list(PartitionedEngine.iter_blocks(self, first))).rows
        self.stats.rows = 0
        return rows

    def _install(self, kmap: ProjectedMap) -> None:
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
        return int(self.kmap.dim)

    def describe(self) -> dict[str, Any]:
        return {**self.kmap.describe(), "structure": self.structure}

    def _fallback(self, what: str, exc: Exception) -> None:
        raise ProjectionRefused(
            f"{refusal(self.structure)}, which failed here ({what}: {first_line(exc, with_type=True, limit=120)})"
        ) from exc

    def _single_projected(
        self, c: int, scale: torch.Tensor, dest: torch.Tensor, where: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Class ``c``'s work row by the plain path (a full row, mapped): the spot check only."""
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
        chunk of coordinates), and the engine's groups of wide work rows are small. With ``out``
        (``[len(classes), dim]`` in the row dtype on the engine's device) the stored rows are
        written straight into it and each block's rows are views of it: ``per_class_gradients``
        at C = 10,000 then copies no C x dim floats per gathered block and again at the end."""
        if out is not None and (out.shape != (len(classes), self.stored_dim) or out.dtype != self.row_dtype):
            raise ValueError(
                f"out must be [{len(classes)}, {self.stored_dim}] {self.row_dtype}, got {out.shape} {out.dtype}"
            )
        kmap, done = self.kmap, 0

        def units_part(block: RowBlock) -> RowBlock:  # the next rows' units' part, in out when given
            nonlocal done
            into = None if out is None else out[done : done + len(block)]
            done += len(block)
            return dataclasses.replace(block, rows=kmap.unit_rows(block.rows, into))

        if kmap.rest_projector is None:
            for block in super().iter_blocks(classes):
                yield units_part(block)
            return
        gather = max(1, min(REST_ROWS, REST_BYTES // (4 * kmap.rest_size)))
        # Held per block: its units' part of the stored rows and a copy of its rest columns (the
        # wide work rows go at once: concatenating them cost a ResNet run at C = 10,000 1.7 s).
        pending: list[tuple[RowBlock, torch.Tensor]] = []

        def with_rest() -> RowBlock:  # the pending blocks as one, their rest projected in
            n = sum(len(b) for b, _ in pending)
            merged = RowBlock.concat([b for b, _ in pending], rows=None if out is None else out[done - n : done])
            kmap.add_rest(merged.rows, torch.cat([r for _, r in pending]))
            pending.clear()
            return merged

        for block in super().iter_blocks(classes):
            rest = block.rows[:, kmap.units_width :].clone()
            pending.append((units_part(block), rest))
            if sum(len(b) for b, _ in pending) >= gather:
                yield with_rest()
        if pending:
            yield with_rest()
