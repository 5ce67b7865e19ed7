"""``projection.structure: dense``: finished rows times a dense Johnson-Lindenstrauss matrix.

Holds ``DenseStructure``: its projector of finished rows (``projection.dense_projector.Projector``: the
matrix generated from a counter-based hash, never stored; ``per_param``: one block per
parameter) and what ``classgrad inspect`` says of its record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from classgrad.store.core.params import ParamSlot
from classgrad.workers.projection.base import ProjectionOptions, ProjectionStructure
from classgrad.workers.projection.dense.dense_projector import Projector
from classgrad.workers.projection.registration import register_structure


class DenseStructure(ProjectionStructure):
    name = "dense"

    def finished(self, options: ProjectionOptions, slots: Sequence[ParamSlot], dim_in: int) -> Projector:
        groups = [(s.offset, s.size) for s in slots] if options.per_param else None
        return Projector(dim_in, options.dim, kind=options.kind, seed=options.seed, groups=groups)

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        return [
            f"projection  {record.get('kind')} to {width} dims (seed {record.get('seed')}); no per-parameter layout"
        ]


register_structure(DenseStructure())
