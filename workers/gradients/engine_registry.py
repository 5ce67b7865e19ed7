"""The engine registry: names to engine classes, ``auto``, and the build of one engine.

Holds ``ENGINES`` (a ``classgrad.registry.Registry``) with ``register_engine``/``create_engine``
(an unknown name lists the choices; every engine has the constructor of ``GradientEngine`` and
one method, ``iter_blocks``; with a projection structure that projects inside the backward, a
``ProjectedEngine`` planned by that structure) and ``resolve_engine_kind`` (``auto``:
partitioned when the loss is class-partitioned and the model treats samples independently,
dense otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from classgrad.config.choices import ENGINE_KINDS
from classgrad.errors import ConfigError, InputError
from classgrad.registry import Registry
from classgrad.workers.allocator import keep_freed_memory
from classgrad.workers.engines.base import GradientEngine, samples_independent
from classgrad.workers.engines.dense_engine import DenseEngine
from classgrad.workers.engines.partitioned import PartitionedEngine
from classgrad.workers.engines.partitioned.projected_engine import (
    ProjectedEngine,
    ProjectedMap,
    ProjectionRefused,
    refusal,
)
from classgrad.workers.engines.reference_engine import ReferenceEngine
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import LossKind
from classgrad.workers.probe import ProbeSet
from classgrad.workers.projection import check_width
from classgrad.workers.projection.base import FALLBACK_STRUCTURE, ResolvedProjection

log = logging.getLogger(__name__)

ENGINES: Registry[type[GradientEngine]] = Registry(
    "engine name",
    unknown="engine.kind {name!r} is unknown (choices: auto, {choices})",
    error=InputError,
    choices=ENGINE_KINDS,
)


def register_engine(cls: type[GradientEngine]) -> type[GradientEngine]:
    if not cls.name or cls.name in ENGINES or cls.name == "auto":
        raise ValueError(f"engine name {cls.name!r} is empty, reserved or already registered")
    return ENGINES.register(cls.name, cls, traits=("partitioned",) if issubclass(cls, PartitionedEngine) else ())


for _cls in (PartitionedEngine, DenseEngine, ReferenceEngine):
    register_engine(_cls)


def resolve_engine_kind(kind: str, model: nn.Module, loss: LossKind) -> str:
    """The engine ``auto`` stands for, or ``kind`` itself once checked."""
    if kind == "auto":
        return "partitioned" if loss.partitioned and samples_independent(model) else "dense"
    ENGINES.get(kind)  # an unknown name: one line with the choices
    return kind


def create_engine(
    kind: str,
    model: nn.Module,
    probe: ProbeSet,
    loss: LossKind,
    layout: ParamLayout,
    projection: ResolvedProjection[Any] | None = None,
    **options: Any,
) -> GradientEngine:
    """Build the engine ``kind`` (``auto`` resolved) with the shared constructor; with a
    ``projection`` whose structure projects inside the backward, a ``ProjectedEngine`` planned by
    that structure, or a one-line refusal when the job cannot take it. For the default structure
    (``projection.fallback``) such a job gets the plain engine instead, with a note saying so: its
    finished rows are then sketched (``ResolvedProjection.finished_projector``). Any other
    structure projects finished rows: the plain engine."""
    keep_freed_memory()  # a fresh process's first call otherwise faults its memory in again and again
    resolved = resolve_engine_kind(kind, model, loss)
    if projection is None or not projection.spec.in_backward:
        return ENGINES[resolved](model, probe, loss, layout, **options)
    structure = projection.structure
    check_width(projection.dim, layout.dim)  # no structure takes it: never a fallback
    why = None
    if not issubclass(ENGINES[resolved], PartitionedEngine):
        why = (
            f"{refusal(structure)}; this job takes the {resolved} engine ({loss.name} loss"
            f"{'' if loss.partitioned else ', dense'})"
        )
    else:
        spec = projection.spec

        def plan(engine: ProjectedEngine, modules: dict[str, nn.Module], covered: set[str]) -> ProjectedMap:
            return spec.plan(projection, engine.full_layout.slots, modules, covered, engine.measure_rows)

        try:
            return ProjectedEngine(model, probe, loss, layout, plan=plan, structure=structure, **options)
        except ConfigError as exc:
            if not projection.fallback:
                raise
            why = exc.why if isinstance(exc, ProjectionRefused) else str(exc)
    if not projection.fallback:
        raise ProjectionRefused(why)
    engine = ENGINES[resolved](model, probe, loss, layout, **options)
    note = f"projection: {why}; finished rows sketched instead (structure: {FALLBACK_STRUCTURE})"
    log.warning(note)
    engine.stats.notes.append(note)
    return engine
