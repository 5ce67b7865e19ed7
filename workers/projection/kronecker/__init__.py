"""``projection.structure: kronecker``: each layer projected as ``P_out dW P_in^T`` inside the
backward. ``kronecker_map`` (the map and the split of ``dim``), ``kronecker_sums`` (its sums
inside the backward), ``kronecker_structure`` (its plan, options and registration)."""

from classgrad.workers.projection.kronecker.kronecker_map import KroneckerMap, KroneckerUnit
from classgrad.workers.projection.kronecker.kronecker_structure import KroneckerStructure

__all__ = ["KroneckerMap", "KroneckerStructure", "KroneckerUnit"]
