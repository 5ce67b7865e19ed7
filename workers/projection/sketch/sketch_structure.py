"""``projection.structure: sketch``: finished rows sketched by sparse signs (``s D`` additions a
row instead of a dense map's ``2 D k`` flops); also the default's stand-in where the hook path
cannot take a job (``FALLBACK_STRUCTURE``).

Holds ``SketchOptions`` (its keys) and ``SketchStructure``: its projector of finished rows
(``projection.sketch.RowSketch``) and what ``classgrad inspect`` says of its record."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from classgrad.config.fields import StrictPositiveInt
from classgrad.config.projection import DEFAULT_SKETCH_NONZEROS, ProjectionConfig
from classgrad.store.core.params import ParamSlot
from classgrad.workers.projection.base import ProjectionStructure, ResolvedProjection
from classgrad.workers.projection.registration import register_structure
from classgrad.workers.projection.sketch.row_sketch import RowSketch


class SketchOptions(ProjectionConfig):
    """`structure: sketch`: each finished row by a sparse sign sketch (s D additions per row)."""

    sketch_nonzeros: StrictPositiveInt = Field(
        DEFAULT_SKETCH_NONZEROS,
        description="Columns each entry of a row is sent to (s; at most dim). Cost grows as s, the error's "
        "tail for rows concentrated on few parameters shrinks with it.",
    )


class SketchStructure(ProjectionStructure[SketchOptions]):
    name = "sketch"
    options = SketchOptions

    def finished(
        self, projection: ResolvedProjection[SketchOptions], slots: Sequence[ParamSlot], dim_in: int
    ) -> RowSketch:
        options = projection.options
        return RowSketch(dim_in, projection.dim, nonzeros=options.sketch_nonzeros, seed=options.seed)

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        return [
            f"projection  sketch (sparse signs, {record.get('nonzeros')} per entry) from {record.get('dim_in')} to "
            f"{width} dims (seed {record.get('seed')}); no per-parameter layout"
        ]


register_structure(SketchStructure())
