"""The one refusal of a ``projection.dim`` wider than the row it projects, whatever the structure.

Holds ``check_width``: the maps (``KroneckerMap``, ``TensorSketchMap``) and the engine registry
check with it, so every place says the same line.
"""

from __future__ import annotations

from classgrad.errors import ConfigError


def check_width(dim: int, row_width: int) -> None:
    """Refuse a ``projection.dim`` larger than the row it projects (the stored row would be wider
    than the row itself)."""
    if dim > row_width:
        raise ConfigError(
            f"projection.dim ({dim}) is larger than the row it projects ({row_width} columns): lower "
            f"projection.dim, or store full rows (projection.dim: null)"
        )
