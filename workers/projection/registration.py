"""The one registration of a projection structure.

Holds ``register_structure``: checks that the structure implements its side of the interface
(``plan`` and ``layer_sums`` inside the backward, ``finished`` otherwise; a ``ProjectedSums`` with
``outer``, each callable taking its family's arguments), hands its layer sums to the layer rules
(``layer_rules.registry.register_projected_sums``), and adds it to ``STRUCTURES``,
which makes its name valid in a job file (``config.choices.STRUCTURES``).
"""

from __future__ import annotations

from classgrad.workers.engines.layer_rules.registry import register_projected_sums, sums_refusal
from classgrad.workers.projection.base import STRUCTURES, ProjectionStructure


def register_structure(structure: ProjectionStructure, *, replace: bool = False) -> ProjectionStructure:
    """Register ``structure`` under its name: a job file may name it; in the backward its layer
    sums go to the layer rules."""
    name = structure.name
    if not name or (not replace and name in STRUCTURES):
        raise ValueError(f"projection structure {name!r} is empty or already registered")
    cls = type(structure)
    sums = structure.layer_sums()
    if structure.in_backward and (cls.plan is ProjectionStructure.plan or sums is None):
        raise ValueError(f"projection structure {name!r} projects in the backward: it needs plan and layer_sums")
    if structure.in_backward and (why := sums_refusal(sums)) is not None:
        raise ValueError(f"projection structure {name!r} projects in the backward: {why}")
    if not structure.in_backward and cls.finished is ProjectionStructure.finished:
        raise ValueError(f"projection structure {name!r} needs a projector of finished rows (finished)")
    if structure.in_backward and sums is not None:
        register_projected_sums(structure.unit_family or name, sums, replace=replace)
    traits = ("in_backward",) if structure.in_backward else ()
    return STRUCTURES.register(name, structure, replace=replace, traits=traits)
