"""Projection structures: one module per structure, each one registration (``base`` says what a
structure implements, ``registration`` registers one). Importing the package registers the
built-ins: ``dense_structure`` and ``sketch`` (finished rows), ``kronecker`` and ``tensorsketch`` (the
default; inside the backward).
"""

from classgrad.workers.structures.base import (
    DEFAULT_STRUCTURE,
    FALLBACK_STRUCTURE,
    STRUCTURES,
    ProjectionOptions,
    ProjectionStructure,
    RowProjector,
    get_structure,
    recorded_structure,
)
from classgrad.workers.structures.dense_structure import DenseStructure
from classgrad.workers.structures.kronecker import KroneckerStructure
from classgrad.workers.structures.records import neighbour_caveat, structure_label, summary_lines
from classgrad.workers.structures.registration import register_structure
from classgrad.workers.structures.sketch import SketchStructure
from classgrad.workers.structures.tensorsketch import TensorSketchStructure

__all__ = [
    "DEFAULT_STRUCTURE",
    "FALLBACK_STRUCTURE",
    "STRUCTURES",
    "DenseStructure",
    "KroneckerStructure",
    "ProjectionOptions",
    "ProjectionStructure",
    "RowProjector",
    "SketchStructure",
    "TensorSketchStructure",
    "get_structure",
    "neighbour_caveat",
    "recorded_structure",
    "register_structure",
    "structure_label",
    "summary_lines",
]
