"""Per-class gradients from a model: the engine registry and the one-call Python API, on top of
the engines (``classgrad.workers.engines``) and the projection structures
(``classgrad.workers.projection``), which both stand below it.

Holds nothing of its own; re-exports what other packages use: ``ENGINES``/``register_engine``/
``create_engine``/``resolve_engine_kind`` (``engine_registry``: importing the package registers the
built-in engines) and ``per_class_gradients``, ``build_engine``, ``projection_options``,
``finished_projector`` and ``stored_width`` (``python_api``).
"""

from __future__ import annotations

from classgrad.workers.gradients.engine_registry import ENGINES, create_engine, register_engine, resolve_engine_kind
from classgrad.workers.gradients.python_api import (
    build_engine,
    finished_projector,
    per_class_gradients,
    projection_options,
    stored_width,
)

__all__ = [
    "ENGINES",
    "build_engine",
    "create_engine",
    "finished_projector",
    "per_class_gradients",
    "projection_options",
    "register_engine",
    "resolve_engine_kind",
    "stored_width",
]
