"""``projection.structure: tensorsketch`` (the default): every outer-product layer sketched inside
the backward into one shared ``dim``-wide sketch of the row, the rest sketched after.

Holds ``TensorSketchOptions`` (its keys) and ``TensorSketchStructure``: the plan of its map
(``plan_map``, a ``projection.TensorSketchMap``: fixed by the layout and the seed, nothing measured;
a store's record checked to match), its layer sums (``layer_rules.sketch_sums``: Linear-like layers'
factors, an embedding table's lookups), and what a store's record says: the placement, the caveat of
the old hashed placement (issue 44), ``classgrad inspect``'s line."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field
from torch import nn

from classgrad.config.fields import StrictPositiveInt
from classgrad.config.projection import DEFAULT_SKETCH_NONZEROS, ProjectionConfig
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.layer_rules.registry import ProjectedSums
from classgrad.workers.engines.partitioned.projected_engine import MeasureRows
from classgrad.workers.projection.base import ProjectionStructure, ResolvedProjection
from classgrad.workers.projection.registration import register_structure
from classgrad.workers.projection.tensorsketch import tensorsketch_sums as sketch_sums
from classgrad.workers.projection.tensorsketch.chunked_sketch import HASHED
from classgrad.workers.projection.tensorsketch.tensorsketch_map import TensorSketchMap

log = logging.getLogger(__name__)


class TensorSketchOptions(ProjectionConfig):
    """`structure: tensorsketch` (the default for a new store): one sketch of the whole row that
    follows each layer's outer product, formed inside the backward: Linear, Conv1d/2d/3d, Embedding,
    EmbeddingBag and transformers' Conv1D layers (the classifier head above all) never form a full
    row; each layer's rows and columns are placed without collisions in chunks of dim, chunks mixed
    by random-phase filters, so no two classes' head rows share their columns; the other parameters
    sketched into the same columns. Over all C classes its nearest neighbours and worst pairs are
    those of a CountSketch of the exact rows (stores made before 2026-12-04 hold a hashed placement
    whose neighbours may be collisions: `classgrad inspect` says which)."""

    sketch_nonzeros: StrictPositiveInt = Field(
        DEFAULT_SKETCH_NONZEROS,
        description="Columns each entry of the parameters sketched after the backward (norms, raw parameters; its "
        "layers' entries are placed, not hashed) is sent to (s; at most dim).",
    )


def plan_map(
    slots: Sequence[ParamSlot],
    modules: dict[str, nn.Module],
    covered: set[str],
    projection: ResolvedProjection[TensorSketchOptions],
) -> TensorSketchMap:
    """The map of rows of ``slots``, ``covered``: the modules the hook path handles (units for
    those of a sketchable type). Fixed by the layout and the seed: a training log plans it once
    from the model (``GradLog``), an engine per job."""
    return TensorSketchMap.plan(
        slots,
        modules,
        covered,
        dim=projection.dim,
        seed=projection.options.seed,
        nonzeros=projection.options.sketch_nonzeros,
        record=projection.record,
    )


class TensorSketchStructure(ProjectionStructure[TensorSketchOptions]):
    name = "tensorsketch"
    options = TensorSketchOptions
    in_backward = True
    unit_family = "tensorsketch"

    def plan(
        self,
        projection: ResolvedProjection[TensorSketchOptions],
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        covered: set[str],
        measure: MeasureRows | None,
    ) -> TensorSketchMap:
        kmap = plan_map(slots, modules, covered, projection)
        log.info(
            "tensorsketch projection: %d layers sketched in the backward, rest of %d parameters, into %d columns",
            len(kmap.units),
            kmap.rest_size,
            kmap.dim,
        )
        return kmap

    def layer_sums(self) -> ProjectedSums:
        return ProjectedSums(
            outer=sketch_sums.sketched_outer_sums,
            embedding=sketch_sums.sketched_table_sums,
            entries=sketch_sums.sketched_entry_sums,
        )

    def label(self, record: Mapping[str, Any]) -> str:
        return f"{self.name}, {record.get('placement', HASHED)} placement"

    def caveat(self, record: Mapping[str, Any]) -> str | None:
        if record.get("placement", HASHED) != HASHED:
            return None
        return (
            "its rows are a hashed tensorsketch (stores made before 2026-12-04), where two classes whose "
            "head rows share a hash bucket look alike: its nearest neighbours may hold hash collisions "
            "(at 10,000 classes and dim 4,096, most classes have one). Rebuild it with the current default "
            "(chunked placement): rerun its job with --set store.overwrite=true"
        )

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        units = record.get("units") or []
        per_layer = (
            "a layer's rows and columns placed without collisions in chunks of the width, chunks mixed by "
            "random-phase filters"
            if record.get("placement")
            else f"one hashed CountSketch of the row: {record.get('unit_nonzeros', 1)} signed entry per coordinate "
            "of a layer"
        )
        return [
            f"projection  {self.label(record)} ({per_layer}; {record.get('nonzeros')} signed entries per "
            f"coordinate of another parameter) from {record.get('dim_in')} to {width} dims "
            f"(seed {record.get('seed')}): "
            f"{len(units)} layers sketched in the backward, {len(record.get('rest_params') or [])} other parameters "
            "sketched after; no per-parameter layout"
        ]


register_structure(TensorSketchStructure())
