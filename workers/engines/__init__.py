"""Gradient engines: the engine interface and the engines themselves (dense, reference and the
partitioned engines of ``partitioned``, with their ``layer_rules``). Their registry and the
one-call API sit above them, in ``classgrad.workers.gradients``; nothing here imports a projection
structure (``ProjectedEngine`` is handed its structure's plan).

Re-exports what other packages use: the engine interface (``base``: ``GradientEngine``,
``EngineStats``, ``RowBlock``) and ``ProjectedEngine`` (rows projected inside the backward).
"""

from __future__ import annotations

from classgrad.workers.engines.base import EngineStats, GradientEngine, RowBlock
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine

__all__ = [
    "EngineStats",
    "GradientEngine",
    "RowBlock",
    "ProjectedEngine",
]
