"""The projection structure interface: what every structure implements, its options, and the
registry.

Holds:
- ``ResolvedProjection``: a job's ``projection`` section resolved for one structure: the
  structure's own options (a ``ProjectionConfig`` subclass, validated by the config), whether an
  unset structure may still give way to ``FALLBACK_STRUCTURE``, and a store's record of it;
  ``resolve_projection`` is the one place a section (and a store's record) becomes one.
- ``ProjectionStructure``: a structure's name, its options model (``options``: the job file
  checks its keys) and whether it projects inside the backward; for one that does, the plan of
  its map (``plan``, run by ``ProjectedEngine``) and its per-layer sums by layer family
  (``layer_sums``: a ``layer_rules.registry.ProjectedSums``, registered with the layer rules); for
  one that does not, the projector of finished rows (``finished``); and what a store's record of
  it says (``label``, ``caveat``, ``summary``).
- ``RowProjector``: what a projector of finished rows offers (``project``, ``out_dim``,
  ``describe``, and its own buffers for the footprint, ``buffers``).
- ``STRUCTURES`` (a ``classgrad.registry.Registry``, publishing each name in
  ``config.choices.STRUCTURES``) with ``get_structure`` (``registration.register_structure`` fills it: this
  module imports nothing of the engines, which import it); ``DEFAULT_STRUCTURE`` (what a
  ``projection`` section with only ``dim`` means for a new store) and ``FALLBACK_STRUCTURE`` (its
  stand-in where the hook path cannot take a job); ``recorded_structure``.

Adding a structure: one module with its options, a subclass and one ``register_structure`` call
(its tests beside). Old stores: ``projection.structure`` unset resolves to what the store recorded (a dense
store's record has no ``structure`` key: it was made before structures existed), so a store made
under an earlier default resumes with the map it was written with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch
from pydantic import ValidationError

from classgrad.config import ProjectionConfig
from classgrad.config.choices import STRUCTURES as STRUCTURE_NAMES
from classgrad.errors import ConfigError, first_line
from classgrad.registry import Registry
from classgrad.store.core.params import ParamSlot

if TYPE_CHECKING:
    from torch import nn

    from classgrad.workers.engines.layer_rules.registry import ProjectedSums
    from classgrad.workers.engines.partitioned.projected_engine import MeasureRows, ProjectedMap

DEFAULT_STRUCTURE = "tensorsketch"
FALLBACK_STRUCTURE = "sketch"


# A structure's options model (its ``ProjectionStructure.options``).
OptionsT = TypeVar("OptionsT", bound=ProjectionConfig)


@dataclass(frozen=True)
class ResolvedProjection(Generic[OptionsT]):
    """A ``projection`` section resolved for one structure.

    ``options``: the structure's options (its ``ProjectionStructure.options`` model, ``structure``
    set); ``fallback``: a new store's default structure, which may give way to
    ``FALLBACK_STRUCTURE`` where the hook path cannot take the job; ``record``: the store's record
    of this structure (reused or checked, so every worker projects the same way)."""

    options: OptionsT
    fallback: bool = False
    record: dict[str, Any] | None = field(default=None, hash=False)  # a dict: not part of the hash

    @property
    def structure(self) -> str:
        return str(self.options.structure)

    @property
    def dim(self) -> int:
        return int(self.options.dim or 0)

    @property
    def spec(self) -> ProjectionStructure[OptionsT]:
        return get_structure(self.structure)

    def finished_projector(self, slots: Sequence[ParamSlot], dim_in: int) -> RowProjector:
        """The projector of finished rows (``slots``: the row's parameters, ``dim_in`` wide): the
        structure's own, or for one that projects inside the backward and could not (the default
        on a job its engine cannot take), its stand-in's, with these options' shared keys."""
        spec = self.spec
        if not spec.in_backward:
            return spec.finished(self, slots, dim_in)
        stand_in = resolve_projection(
            self.options.model_copy(update={"structure": FALLBACK_STRUCTURE}), None, fallback=False
        )
        assert stand_in is not None
        return stand_in.spec.finished(stand_in, slots, dim_in)


def resolve_projection(
    config: ProjectionConfig | None, record: Any = None, *, fallback: bool | None = None
) -> ResolvedProjection[Any] | None:
    """The projection ``config`` names (None: rows stored whole); ``record``: a store's
    ``projection`` attribute, whose structure an unset ``projection.structure`` resumes with. The
    section is validated again by the resolved structure's options model: a key it lacks, set
    where the structure was unset, is one line."""
    if config is None or config.dim is None:
        return None
    per_param = bool(getattr(config, "per_param", False))
    structure = config.structure or recorded_structure(record) or ("dense" if per_param else DEFAULT_STRUCTURE)
    spec = get_structure(structure)  # unknown: one line
    given = config.model_dump(exclude_unset=True) | {"dim": config.dim, "seed": config.seed, "structure": structure}
    try:
        options = spec.options.model_validate(given)
    except ValidationError as exc:
        raise ConfigError(f"projection: {first_line(exc)}") from None
    return ResolvedProjection(
        options=options,
        fallback=(config.structure is None and record is None) if fallback is None else fallback,
        record=record if recorded_structure(record) == structure else None,
    )


class RowProjector(Protocol):
    """A projector of finished rows ``[n, dim_in] -> [n, out_dim]``, and the store's record of it."""

    @property
    def out_dim(self) -> int: ...

    def project(self, rows: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> dict[str, Any]: ...

    def buffers(self) -> list[tuple[str, int, str]]:
        """What it holds while it projects, for the footprint: ``(what, bytes, the job file key
        that sizes it)`` each."""
        ...


class ProjectionStructure(Generic[OptionsT]):
    """One projection structure. Subclasses set ``name``, ``options`` (the model of their keys in
    a job file: a ``ProjectionConfig`` subclass) and ``in_backward``, and implement ``plan`` and
    ``layer_sums`` (in the backward) or ``finished`` (of finished rows)."""

    name: ClassVar[str] = ""
    options: ClassVar[type[ProjectionConfig]] = ProjectionConfig
    in_backward: ClassVar[bool] = False
    # The ``structure`` its units name (``KroneckerUnit.structure``...): the key of its
    # ``layer_sums`` with the layer rules (a structure reusing another's units shares its sums).
    unit_family: ClassVar[str] = ""

    def plan(
        self,
        projection: ResolvedProjection[OptionsT],
        slots: Sequence[ParamSlot],
        modules: dict[str, nn.Module],
        covered: set[str],
        measure: MeasureRows | None,
    ) -> ProjectedMap:
        """The map of rows of ``slots`` projected inside the backward (``KroneckerMap``,
        ``TensorSketchMap``): its units for the layers the hook path covers (``covered``: names in
        ``modules``), the rest after. ``measure``: work rows of a job's first classes through a
        draft map, for a map that measures them (the Kronecker split); None in a training log,
        which plans from the model alone."""
        raise NotImplementedError(f"projection structure {self.name!r} does not project inside the backward")

    def layer_sums(self) -> ProjectedSums | None:
        """The per-class sums of its projected rows by layer family (``layer_rules`` calls them:
        ``outer`` always, ``embedding`` and ``entries`` where its map has units for those layers)."""
        return None

    def finished(
        self, projection: ResolvedProjection[OptionsT], slots: Sequence[ParamSlot], dim_in: int
    ) -> RowProjector:
        """The projector of finished rows of ``dim_in`` columns (``slots``: the row's parameters)."""
        raise NotImplementedError(f"projection structure {self.name!r} projects inside the backward")

    def label(self, record: Mapping[str, Any]) -> str:
        """The store's rows in a few words."""
        return self.name

    def caveat(self, record: Mapping[str, Any]) -> str | None:
        """What to tell a user who ranks the classes of a store with these rows (None: nothing)."""
        return None

    def summary(self, record: Mapping[str, Any], width: int) -> list[str]:
        """``classgrad inspect``'s lines for a store's record (``width``: stored columns)."""
        return [
            f"projection  {self.label(record)} to {width} dims (seed {record.get('seed')}); no per-parameter layout"
        ]


STRUCTURES: Registry[ProjectionStructure[Any]] = Registry(
    "projection structure",
    unknown="projection.structure {name!r} is unknown (choices: {choices})",
    error=ConfigError,
    choices=STRUCTURE_NAMES,
)


def get_structure(name: str) -> ProjectionStructure[Any]:
    return STRUCTURES.get(name)


def recorded_structure(record: Any) -> str | None:
    """The structure a store's ``projection`` attribute was written with (None: no projection)."""
    if not isinstance(record, Mapping):
        return None
    return str(record.get("structure", "dense"))
