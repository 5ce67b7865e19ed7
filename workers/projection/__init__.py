"""Projections of gradient rows to ``projection.dim`` columns: one module per structure.

Holds the re-exports of ``dense`` (the counter-based hash and the dense Johnson-Lindenstrauss
``Projector``), ``sketch`` (sparse sign sketches), ``kronecker`` (``P_a M P_b^T`` per layer),
``tensor_sketch`` (the default: one sketch of the row along each layer's outer product; its
units in ``chunked_sketch``), ``structures`` (the registry of structures, the default, old stores' records) and
``rows`` (the projector of finished rows a job asks for).
"""

from classgrad.workers.projection.dense import (
    HASH_NAME,
    PROJECTIONS,
    ProjectionKind,
    Projector,
    create_projection,
    mix32,
    mix32_,
    mix32_int,
    register_projection,
    stream_keys,
    stream_words,
)
from classgrad.workers.projection.kronecker import KroneckerMap, KroneckerUnit
from classgrad.workers.projection.rows import row_projector
from classgrad.workers.projection.sketch import RowSketch, SparseSignSketch
from classgrad.workers.projection.structures import (
    DEFAULT_STRUCTURE,
    FALLBACK_STRUCTURE,
    STRUCTURES,
    Structure,
    check_width,
    get_structure,
    neighbour_caveat,
    recorded_structure,
    register_structure,
    resolve_structure,
    structure_label,
)
from classgrad.workers.projection.tensor_sketch import SketchUnit, TensorSketchMap

__all__ = [
    "DEFAULT_STRUCTURE",
    "FALLBACK_STRUCTURE",
    "HASH_NAME",
    "PROJECTIONS",
    "STRUCTURES",
    "KroneckerMap",
    "KroneckerUnit",
    "ProjectionKind",
    "Projector",
    "RowSketch",
    "SketchUnit",
    "SparseSignSketch",
    "Structure",
    "check_width",
    "TensorSketchMap",
    "create_projection",
    "get_structure",
    "mix32",
    "mix32_",
    "mix32_int",
    "neighbour_caveat",
    "recorded_structure",
    "register_projection",
    "register_structure",
    "resolve_structure",
    "row_projector",
    "stream_keys",
    "stream_words",
    "structure_label",
]
