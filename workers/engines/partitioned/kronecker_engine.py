"""The partitioned engine with Kronecker-projected rows (``projection.structure: kronecker``).

Holds ``KroneckerEngine``, a ``ProjectedEngine`` (see ``projected_engine``) whose map is a
``classgrad.workers.projection.KroneckerMap``: each Kronecker layer projected as ``P_a M P_b^T``
(``layer_rules.kronecker_sums``), the rest kept, projected densely or sketched; the split of
``dim`` among layers measured on the first block of classes (``allocation: norm``) and recorded.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from classgrad.workers.engines.base import RowBlock
from classgrad.workers.engines.partitioned.engine import PartitionedEngine
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine, refusal
from classgrad.workers.projection.kronecker import MEASURE_CLASSES, KroneckerMap

log = logging.getLogger(__name__)

REFUSAL = refusal("kronecker")


class KroneckerEngine(ProjectedEngine):
    """Rows of ``dim`` columns: Kronecker layers projected in the backward, the rest kept or dense.

    ``projection``: ``dim``, ``kind``, ``seed``, ``rest`` (keep|dense|sketch), ``sketch_nonzeros``
    (rest: sketch), ``allocation`` (norm|size),
    ``low_rank`` (dense|kronecker), ``dense_layers`` (module name patterns left to the rest) and
    optionally ``record`` (a store's ``projection`` attribute: its split is reused, so every
    worker of a job projects the same way).
    """

    structure = "kronecker"

    def _plan(self, projection: dict[str, Any], modules: dict[str, nn.Module], covered: set[str]) -> KroneckerMap:
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
        self._install(kmap)  # the first block below runs through it
        if record is None and kmap.units:
            # The first block of classes, projected with the split by size: the layers whose
            # gradient reaches one token per sample (low_rank: dense) and every part's squared
            # norm (allocation: norm).
            first = list(range(min(MEASURE_CLASSES, self.loss.num_classes)))
            work = RowBlock.concat(list(PartitionedEngine.iter_blocks(self, first))).rows  # work rows
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
        log.info(
            "kronecker projection: %d layers in %d columns, rest %s (%d parameters) in %d",
            len(kmap.units),
            kmap.units_width,
            kmap.rest_mode,
            kmap.rest_size,
            kmap.dim - kmap.units_width,
        )
        return kmap
