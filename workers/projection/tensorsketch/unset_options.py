"""What a ``projection`` section without ``structure`` may mean, and so which keys it takes (here,
beside the default structure that an unset one means for a new store).

Holds ``UnsetOptions``, registered as the options of an unset structure: a new store takes
``DEFAULT_STRUCTURE`` (tensorsketch) or its stand-in ``FALLBACK_STRUCTURE`` (sketch), and a resume
takes what the store recorded, ``dense`` for a store made before structures existed; so it has the
keys of those three. Once the structure is known, ``resolve_projection`` validates the keys set
again with that structure's own options.
"""

from __future__ import annotations

from classgrad.config.projection import register_projection_options
from classgrad.workers.projection.dense.dense_structure import DenseOptions
from classgrad.workers.projection.sketch.sketch_structure import SketchOptions
from classgrad.workers.projection.tensorsketch.tensorsketch_structure import TensorSketchOptions


class UnsetOptions(DenseOptions, SketchOptions, TensorSketchOptions):
    """`structure` unset: the keys of dense, sketch and tensorsketch."""


register_projection_options(None, UnsetOptions)
