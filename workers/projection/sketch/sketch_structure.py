"""``projection.structure: sketch``: finished rows sketched by sparse signs (``s D`` additions a
row instead of a dense map's ``2 D k`` flops); also the default's stand-in where the hook path
cannot take a job (``FALLBACK_STRUCTURE``).

Holds ``SketchStructure``: its projector of finished rows (``projection.sketch.RowSketch``) and
what ``classgrad inspect`` says of its record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from classgrad.store.core.params import ParamSlot
from classgrad.workers.projection.base import ProjectionOptions, ProjectionStructure
from classgrad.workers.projection.registration import register_structure
from classgrad.workers.projection.sketch.row_sketch import RowSketch


class SketchStructure(ProjectionStructure):
    name = "sketch"

    def finished(self, options: ProjectionOptions, slots: Sequence[ParamSlot], dim_in: int) -> RowSketch:
        return RowSketch(dim_in, options.dim, nonzeros=options.sketch_nonzeros, seed=options.seed)

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        return [
            f"projection  sketch (sparse signs, {record.get('nonzeros')} per entry) from {record.get('dim_in')} to "
            f"{width} dims (seed {record.get('seed')}); no per-parameter layout"
        ]


register_structure(SketchStructure())
