"""Gradient engines: the registry (``registry``), the one-call API (``api``) and the engines.

Re-exports what other packages use: ``per_class_gradients``, ``build_engine``,
``projection_options``, ``finished_projector`` and ``stored_width`` (``api``), ``ENGINES``/``register_engine``/
``create_engine``/``resolve_engine_kind`` (``registry``), the engine interface (``base``) and
``ProjectedEngine`` (rows projected inside the backward, by a structure of
``classgrad.workers.structures``).
"""

from __future__ import annotations

from classgrad.workers.engines.api import (
    build_engine,
    finished_projector,
    per_class_gradients,
    projection_options,
    stored_width,
)
from classgrad.workers.engines.base import EngineStats, GradientEngine, RowBlock
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine
from classgrad.workers.engines.registry import ENGINES, create_engine, register_engine, resolve_engine_kind

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
    "ProjectedEngine",
    "finished_projector",
    "projection_options",
    "stored_width",
]
