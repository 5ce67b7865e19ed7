"""The projector of finished rows that a job's ``projection`` settings ask for.

Holds ``row_projector``: a dense ``Projector`` (``structure: dense``), a ``RowSketch``
(``structure: sketch``), or None (rows stored whole, or projected inside the backward by the
Kronecker engine). The workers and ``per_class_gradients`` both build theirs here, so a job and
the Python API project rows identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from classgrad.workers.layout import ParamSlot
from classgrad.workers.projection import Projector
from classgrad.workers.sketch import RowSketch


def row_projector(projection: Any, slots: Sequence[ParamSlot], dim_in: int) -> Projector | RowSketch | None:
    """``projection``: a ``ProjectionConfig`` (or None); ``slots``: the row's parameters."""
    if projection is None or projection.dim is None or projection.structure == "kronecker":
        return None
    if projection.structure == "sketch":
        return RowSketch(dim_in, projection.dim, nonzeros=projection.sketch_nonzeros, seed=projection.seed)
    groups = [(s.offset, s.size) for s in slots] if projection.per_param else None
    return Projector(dim_in, projection.dim, kind=projection.kind, seed=projection.seed, groups=groups)
