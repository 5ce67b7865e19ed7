"""The projector of finished rows that a job's ``projection`` settings ask for.

Holds ``row_projector``: a dense ``Projector`` (``structure: dense``), a ``RowSketch``
(``structure: sketch``, also the default's stand-in where the hook path cannot take the job), or
None (rows stored whole, or projected inside the backward by the engine). The workers and
``per_class_gradients`` both build theirs here, so a job and the Python API project rows
identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from classgrad.store.params import ParamSlot
from classgrad.workers.projection.dense import Projector
from classgrad.workers.projection.sketch import RowSketch
from classgrad.workers.projection.structures import FALLBACK_STRUCTURE, create_row_projector, get_structure


def row_projector(
    projection: Any, slots: Sequence[ParamSlot], dim_in: int, *, structure: str | None = None, in_engine: bool = False
) -> Projector | RowSketch | None:
    """``projection``: a ``ProjectionConfig`` (or None); ``slots``: the row's parameters;
    ``structure``: the resolved structure (default: the config's, else the default);
    ``in_engine``: the engine already projects (a ``ProjectedEngine``)."""
    if projection is None or projection.dim is None or in_engine:
        return None
    name = structure or projection.structure
    if name is None or get_structure(name).in_backward:
        # An in-backward structure whose engine could not be built (only the default gets here):
        # its stand-in sketches finished rows.
        name = FALLBACK_STRUCTURE
    return create_row_projector(name, projection, slots, dim_in)
