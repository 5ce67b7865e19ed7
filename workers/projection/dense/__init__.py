"""``projection.structure: dense``: finished rows times a dense Johnson-Lindenstrauss matrix
(``dense_projector``: the counter-based hash every structure's random entries come from, and the
``Projector``), registered by ``dense_structure``."""

from classgrad.workers.projection.dense.dense_projector import (
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
from classgrad.workers.projection.dense.dense_structure import DenseStructure

__all__ = [
    "HASH_NAME",
    "PROJECTIONS",
    "DenseStructure",
    "ProjectionKind",
    "Projector",
    "create_projection",
    "mix32",
    "mix32_",
    "mix32_int",
    "register_projection",
    "stream_keys",
    "stream_words",
]
