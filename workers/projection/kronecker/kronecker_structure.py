"""``projection.structure: kronecker``: each Kronecker layer's gradient projected inside the
backward as ``P_out dW P_in^T``, the rest kept, projected densely or sketched.

Holds ``KroneckerStructure``: the plan of its map (``projection.KroneckerMap``; the split of
``dim`` among layers measured on the first block of classes, ``allocation: norm``, and recorded,
so every worker and every resume reuses it), its layer sums (``layer_rules.kronecker_sums``),
and ``classgrad inspect``'s lines for its record (every layer's factor shapes and columns).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from classgrad.workers.engines.layer_rules.registry import ProjectedSums
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine
from classgrad.workers.projection.base import ProjectionOptions, ProjectionStructure
from classgrad.workers.projection.kronecker import kronecker_sums
from classgrad.workers.projection.kronecker.kronecker_map import MEASURE_CLASSES, KroneckerMap
from classgrad.workers.projection.registration import register_structure

log = logging.getLogger(__name__)


class KroneckerStructure(ProjectionStructure):
    name = "kronecker"
    in_backward = True
    unit_family = "kronecker"

    def plan(
        self, engine: ProjectedEngine, options: ProjectionOptions, modules: dict[str, nn.Module], covered: set[str]
    ) -> KroneckerMap:
        record = options.record
        slots = engine.full_layout.slots
        dense_layers = options.dense_layers
        if record is not None:  # the layers the driver left to the rest, low-rank ones included
            dense_layers = tuple(record.get("dense_layers") or ())
        settings: dict[str, Any] = {
            "dim": options.dim,
            "kind": options.kind,
            "seed": options.seed,
            "rest_mode": options.rest,
            "allocation": options.allocation,
            "sketch_nonzeros": options.sketch_nonzeros,
            "low_rank": options.low_rank,
        }
        kmap = KroneckerMap.plan(slots, modules, covered, fixed=record, dense_layers=dense_layers, **settings)
        if record is None and kmap.units:
            kmap = self._measured(engine, kmap, modules, covered, dense_layers, settings)
        log.info(
            "kronecker projection: %d layers in %d columns, rest %s (%d parameters) in %d",
            len(kmap.units),
            kmap.units_width,
            kmap.rest_mode,
            kmap.rest_size,
            kmap.dim - kmap.units_width,
        )
        return kmap

    @staticmethod
    def _measured(
        engine: ProjectedEngine,
        kmap: KroneckerMap,
        modules: dict[str, nn.Module],
        covered: set[str],
        dense_layers: tuple[str, ...],
        settings: dict[str, Any],
    ) -> KroneckerMap:
        """The first block of classes, projected with the split by size: the layers whose gradient
        reaches one token per sample (``low_rank: dense``) join the rest, and every part's squared
        norm sets the split (``allocation: norm``)."""
        first = list(range(min(MEASURE_CLASSES, engine.loss.num_classes)))
        measured = kmap.measure(engine.work_rows(kmap, first))
        low_rank = settings["low_rank"]
        is_low = [low_rank == "dense" and u.positions is not None and u.positions <= 1 for u in kmap.units]
        if any(is_low):
            positions = {u.weight.name: u.positions for u in kmap.units}
            low_names = tuple(u.weight.name.rpartition(".")[0] for u, flag in zip(kmap.units, is_low) if flag)
            moved = sum(m for m, flag in zip(measured, is_low) if flag)
            measured = [m for m, flag in zip(measured, is_low) if not flag] + [measured[-1] + moved]
            kmap = KroneckerMap.plan(
                engine.full_layout.slots, modules, covered, dense_layers=(*dense_layers, *low_names), **settings
            )
            for u in kmap.units:
                u.positions = positions[u.weight.name]
        return kmap.remeasured(measured) if settings["allocation"] == "norm" else kmap

    def layer_sums(self) -> ProjectedSums:
        return ProjectedSums(
            outer=kronecker_sums.projected_outer_sums, embedding=kronecker_sums.projected_embedding_sums
        )

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        """Every layer's factor shapes and columns, then the rest."""
        units = record.get("units") or []
        lines = [
            f"projection  kronecker ({record.get('kind')}, seed {record.get('seed')}, split by "
            f"{record.get('allocation')}) to {width} dims from {record.get('dim_in')}: {len(units)} layers "
            "projected as P_out W P_in^T",
        ]
        name_width = max([len(str(u.get("param"))) for u in units] + [5])
        for u in units:
            (ko, a), (ki, b) = u["factor_shapes"]
            bias = " + bias" if u.get("bias") else ""
            norm = u.get("measured_sq_norm")
            measured = "" if norm is None else f"  measured |g|^2 {norm:.4g}"
            where = f"{u['width']:>7,} cols at {u['offset']}"
            lines.append(f"  {u['param']:<{name_width}}  [{a}x{b}]{bias:<7} -> {ko} x {ki} = {where}{measured}")
        rest = record.get("rest_params") or []
        if rest:
            sketch = record.get("rest_sketch") or {}
            how = {
                "keep": "kept whole",
                "sketch": f"sparse sign sketch, {sketch.get('nonzeros')} nonzeros per parameter",
            }.get(str(record.get("rest")), "projected densely")
            lines.append(
                f"  rest ({how}): {record.get('rest_width')} cols at {record.get('rest_offset')}: {', '.join(rest[:8])}"
                f"{' ...' if len(rest) > 8 else ''}"
            )
        return lines


register_structure(KroneckerStructure())
