"""Projection of gradient rows to ``projection.dim`` columns: the interface every structure
implements, and one package per structure.

Holds the interface (``base``: ``ProjectionStructure``, ``RowProjector``, the ``STRUCTURES``
registry; ``registration.register_structure``; ``records``: what a store's record says, whatever
its structure), the pieces several structures share (``outer_matrix``, ``width``), and the
built-in structures, each a package that owns its map, its sums inside the backward, its options
and its memory: ``dense`` (the counter-based hash and the dense Johnson-Lindenstrauss
``Projector``), ``sketch`` (sparse sign sketches of finished rows), ``kronecker`` (``P_a M P_b^T``
per layer) and ``tensorsketch`` (the default: one sketch of the row along each layer's outer
product). ``tensorsketch.unset_options`` says which keys a section without ``structure`` takes. Importing
the package registers the built-ins.
"""

from classgrad.workers.projection.base import (
    DEFAULT_STRUCTURE,
    FALLBACK_STRUCTURE,
    STRUCTURES,
    ProjectionStructure,
    ResolvedProjection,
    RowProjector,
    get_structure,
    recorded_structure,
    resolve_projection,
)
from classgrad.workers.projection.dense import (
    HASH_NAME,
    PROJECTIONS,
    DenseStructure,
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
from classgrad.workers.projection.kronecker import KroneckerMap, KroneckerStructure, KroneckerUnit
from classgrad.workers.projection.records import neighbour_caveat, structure_label, summary_lines
from classgrad.workers.projection.registration import register_structure
from classgrad.workers.projection.sketch import RowSketch, SketchStructure, SparseSignSketch
from classgrad.workers.projection.tensorsketch import SketchUnit, TensorSketchMap, TensorSketchStructure, UnsetOptions
from classgrad.workers.projection.width import check_width

__all__ = [
    "DEFAULT_STRUCTURE",
    "FALLBACK_STRUCTURE",
    "HASH_NAME",
    "PROJECTIONS",
    "STRUCTURES",
    "DenseStructure",
    "KroneckerMap",
    "KroneckerStructure",
    "KroneckerUnit",
    "ProjectionKind",
    "ProjectionStructure",
    "ResolvedProjection",
    "Projector",
    "RowProjector",
    "RowSketch",
    "SketchStructure",
    "SketchUnit",
    "SparseSignSketch",
    "TensorSketchMap",
    "TensorSketchStructure",
    "UnsetOptions",
    "check_width",
    "create_projection",
    "get_structure",
    "mix32",
    "mix32_",
    "mix32_int",
    "neighbour_caveat",
    "recorded_structure",
    "register_projection",
    "register_structure",
    "resolve_projection",
    "stream_keys",
    "stream_words",
    "structure_label",
    "summary_lines",
]
