"""The one registration of a projection structure.

Holds ``register_structure``: checks that the structure implements its side of the interface
(``plan`` and ``layer_sums`` inside the backward, ``finished`` otherwise; a ``ProjectedSums`` with
``outer``, each callable taking its family's arguments) and has an options model (a
``ProjectionConfig`` subclass); hands its layer sums to the layer rules
(``layer_rules.registry.register_projected_sums``) and its options to the config
(``config.projection.register_projection_options``: a job file naming it is checked against its
keys), and adds it to ``STRUCTURES``, which makes its name valid in a job file
(``config.choices.STRUCTURES``).
"""

from __future__ import annotations

from typing import Any

from classgrad.config.projection import ProjectionConfig, register_projection_options
from classgrad.workers.engines.layer_rules.registry import register_projected_sums, sums_refusal
from classgrad.workers.projection.base import STRUCTURES, ProjectionStructure


def register_structure(structure: ProjectionStructure[Any], *, replace: bool = False) -> ProjectionStructure[Any]:
    """Register ``structure`` under its name: a job file may name it; in the backward its layer
    sums go to the layer rules."""
    name = structure.name
    if not name or (not replace and name in STRUCTURES):
        raise ValueError(f"projection structure {name!r} is empty or already registered")
    cls = type(structure)
    options = structure.options
    if not (isinstance(options, type) and issubclass(options, ProjectionConfig)):
        raise ValueError(f"projection structure {name!r}: its options {options!r} are not a ProjectionConfig subclass")
    sums = structure.layer_sums()
    if structure.in_backward and (cls.plan is ProjectionStructure.plan or sums is None):
        raise ValueError(f"projection structure {name!r} projects in the backward: it needs plan and layer_sums")
    if structure.in_backward and (why := sums_refusal(sums)) is not None:
        raise ValueError(f"projection structure {name!r} projects in the backward: {why}")
    if not structure.in_backward and cls.finished is ProjectionStructure.finished:
        raise ValueError(f"projection structure {name!r} needs a projector of finished rows (finished)")
    if structure.in_backward and sums is not None:
        register_projected_sums(structure.unit_family or name, sums, replace=replace)
    register_projection_options(name, options)
    traits = ("in_backward",) if structure.in_backward else ()
    return STRUCTURES.register(name, structure, replace=replace, traits=traits)
