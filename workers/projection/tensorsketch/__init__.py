"""``projection.structure: tensorsketch`` (the default): one sketch of the row along each layer's
outer product, inside the backward. ``tensorsketch_map`` (the map), ``chunked_sketch`` (its
units' placement), ``tensorsketch_sums`` (its sums inside the backward, route by route),
``tensorsketch_structure`` (its plan, options and registration), ``unset_options`` (the keys of a
section without ``structure``, which means this structure for a new store)."""

from classgrad.workers.projection.tensorsketch.tensorsketch_map import SketchUnit, TensorSketchMap
from classgrad.workers.projection.tensorsketch.tensorsketch_structure import TensorSketchStructure
from classgrad.workers.projection.tensorsketch.unset_options import UnsetOptions

__all__ = ["SketchUnit", "TensorSketchMap", "TensorSketchStructure", "UnsetOptions"]
