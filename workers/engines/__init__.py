"""Gradient engines: the registry (``registry``), the one-call API (``api``) and the engines.

Re-exports what other packages use: ``per_class_gradients`` and ``build_engine``
(``api``), ``ENGINES``/``register_engine``/``create_engine``/``resolve_engine_kind`` and
``PROJECTED_ENGINES`` (``registry``), the engine interface (``base``) and the projected engines.
"""

from __future__ import annotations

from classgrad.workers.engines.api import (
    build_engine,
    finished_projector,
    per_class_gradients,
    projected_options,
    projection_options,
)
from classgrad.workers.engines.base import EngineStats, GradientEngine, RowBlock
from classgrad.workers.engines.partitioned.kronecker_engine import KroneckerEngine
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine, TensorSketchEngine
from classgrad.workers.engines.registry import (
    ENGINES,
    PROJECTED_ENGINES,
    create_engine,
    register_engine,
    resolve_engine_kind,
)

__all__ = [
    "ENGINES",
    "EngineStats",
    "GradientEngine",
    "RowBlock",
    "create_engine",
    "per_class_gradients",
    "register_engine",
    "resolve_engine_kind",
    "build_engine",
    "KroneckerEngine",
    "PROJECTED_ENGINES",
    "ProjectedEngine",
    "TensorSketchEngine",
    "finished_projector",
    "projected_options",
    "projection_options",
]
