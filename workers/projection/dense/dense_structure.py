"""``projection.structure: dense``: finished rows times a dense Johnson-Lindenstrauss matrix.

Holds ``DenseOptions`` (its keys) and ``DenseStructure``: its projector of finished rows
(``projection.dense_projector.Projector``: the matrix generated from a counter-based hash, never
stored; ``per_param``: one block per parameter) and what ``classgrad inspect`` says of its record."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from classgrad.config.projection import DEFAULT_KIND, ProjectionConfig, ProjectionKind
from classgrad.store.core.params import ParamSlot
from classgrad.workers.projection.base import ProjectionStructure, ResolvedProjection
from classgrad.workers.projection.dense.dense_projector import Projector
from classgrad.workers.projection.registration import register_structure


class DenseOptions(ProjectionConfig):
    """`structure: dense`: each finished row times a k-column random matrix (2 D k flops per row),
    generated from the seed block by block, never stored."""

    kind: ProjectionKind = Field(
        DEFAULT_KIND, description="Distribution of the random matrix's entries: random signs or Gaussian."
    )
    per_param: bool = Field(
        False,
        description="Use a separate projection for each selected parameter instead of one over the whole row.",
    )


class DenseStructure(ProjectionStructure[DenseOptions]):
    name = "dense"
    options = DenseOptions

    def finished(
        self, projection: ResolvedProjection[DenseOptions], slots: Sequence[ParamSlot], dim_in: int
    ) -> Projector:
        options = projection.options
        groups = [(s.offset, s.size) for s in slots] if options.per_param else None
        return Projector(dim_in, projection.dim, kind=options.kind, seed=options.seed, groups=groups)

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        return [
            f"projection  {record.get('kind')} to {width} dims (seed {record.get('seed')}); no per-parameter layout"
        ]


register_structure(DenseStructure())
