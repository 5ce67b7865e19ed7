"""``projection.structure: sketch``: finished rows by sparse signs (``row_sketch``: also the rest
of the Kronecker and TensorSketch maps), registered by ``sketch_structure``."""

from classgrad.workers.projection.sketch.row_sketch import RowSketch, SparseSignSketch
from classgrad.workers.projection.sketch.sketch_structure import SketchStructure

__all__ = ["RowSketch", "SketchStructure", "SparseSignSketch"]
