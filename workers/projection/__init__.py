"""Projections of gradient rows to ``projection.dim`` columns: the maps, one module each.

Holds the re-exports of ``dense_projector`` (the counter-based hash and the dense Johnson-Lindenstrauss
``Projector``), ``sketch`` (sparse sign sketches), ``kronecker`` (``P_a M P_b^T`` per layer),
``tensor_sketch`` (the default: one sketch of the row along each layer's outer product; its
units in ``chunked_sketch``) and ``width`` (the one refusal of a ``dim`` wider than the row). The
maps only: which structure uses which, and how, is ``classgrad.workers.structures``.
"""

from classgrad.workers.projection.dense_projector import (
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
from classgrad.workers.projection.sketch import RowSketch, SparseSignSketch
from classgrad.workers.projection.tensor_sketch import SketchUnit, TensorSketchMap
from classgrad.workers.projection.width import check_width

__all__ = [
    "HASH_NAME",
    "PROJECTIONS",
    "KroneckerMap",
    "KroneckerUnit",
    "ProjectionKind",
    "Projector",
    "RowSketch",
    "SketchUnit",
    "SparseSignSketch",
    "check_width",
    "TensorSketchMap",
    "create_projection",
    "mix32",
    "mix32_",
    "mix32_int",
    "register_projection",
    "stream_keys",
    "stream_words",
]
