"""What the analysis commands say of a store's rows, from its ``projection`` record, whatever the
structure: ``structure_label`` (a few words), ``neighbour_caveat`` (what to tell a user who ranks
its classes) and ``summary_lines`` (``classgrad inspect``'s lines). A record of a structure this
process does not know (a plugin's, not imported) is named, not refused.
"""

from __future__ import annotations

from typing import Any

from classgrad.workers.projection.base import STRUCTURES, recorded_structure


def structure_label(record: Any) -> str:
    """A store's rows in a few words ("tensorsketch, chunked placement"; "full rows" without one)."""
    name = recorded_structure(record)
    if name is None:
        return "full rows"
    spec = STRUCTURES.find(name)
    return spec.label(record) if spec else name


def neighbour_caveat(record: Any) -> str | None:
    """What to tell a user who ranks the classes of a store whose rows may hold false neighbours."""
    name = recorded_structure(record)
    spec = STRUCTURES.find(name) if name else None
    return spec.caveat(record) if spec else None


def summary_lines(record: Any, width: int) -> list[str]:
    """``classgrad inspect``'s lines for a store's projection (none for full rows)."""
    name = recorded_structure(record) if record else None
    if name is None:
        return []
    spec = STRUCTURES.find(name)
    if spec is None:
        return [f"projection  {name} to {width} dims (seed {record.get('seed')}); not registered in this process"]
    return spec.summary(record, width)
