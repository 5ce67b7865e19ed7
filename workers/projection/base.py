"""The projection structure interface: what every structure implements, its typed options, and the
registry.

Holds:
- ``ProjectionOptions``: a job's ``projection`` section resolved for one structure (typed, with a
  store's record of it); ``ProjectionOptions.resolve`` is the one place a ``ProjectionConfig``
  (and a store's record) becomes options.
- ``ProjectionStructure``: a structure's name and whether it projects inside the backward; for
  one that does, the plan of its map (``plan``, run by ``ProjectedEngine``) and its per-layer
  sums by layer family (``layer_sums``: a ``layer_rules.registry.ProjectedSums``, registered with
  the layer rules); for one that does not,
  the projector of finished rows (``finished``); and what a store's record of it says
  (``label``, ``caveat``, ``summary``).
- ``RowProjector``: what a projector of finished rows offers (``project``, ``out_dim``, ``describe``).
- ``STRUCTURES`` (a ``classgrad.registry.Registry``, publishing each name in
  ``config.choices.STRUCTURES``) with ``get_structure`` (``registration.register_structure`` fills it: this
  module imports nothing of the engines, which import it); ``DEFAULT_STRUCTURE`` (what a
  ``projection`` section with only ``dim`` means for a new store) and ``FALLBACK_STRUCTURE`` (its
  stand-in where the hook path cannot take a job); ``recorded_structure``.

Adding a structure: one module with a subclass and one ``register_structure`` call (its tests
beside). Old stores: ``projection.structure`` unset resolves to what the store recorded (a dense
store's record has no ``structure`` key: it was made before structures existed), so a store made
under an earlier default resumes with the map it was written with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from classgrad.config import ProjectionConfig
from classgrad.config.choices import STRUCTURES as STRUCTURE_NAMES
from classgrad.errors import ConfigError
from classgrad.registry import Registry
from classgrad.store.core.params import ParamSlot

if TYPE_CHECKING:
    from torch import nn

    from classgrad.workers.engines.layer_rules.registry import ProjectedSums
    from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine

DEFAULT_STRUCTURE = "tensorsketch"
FALLBACK_STRUCTURE = "sketch"


@dataclass(frozen=True)
class ProjectionOptions:
    """The settings a structure reads (``ProjectionConfig``'s fields, defaults stated once there).

    ``fallback``: a new store's default structure, which may give way to ``FALLBACK_STRUCTURE``
    where the hook path cannot take the job; ``record``: the store's record of this structure
    (reused or checked, so every worker projects the same way)."""

    structure: str
    dim: int
    seed: int
    kind: str
    sketch_nonzeros: int
    rest: str
    allocation: str
    low_rank: str
    dense_layers: tuple[str, ...]
    per_param: bool
    fallback: bool = False
    record: dict[str, Any] | None = field(default=None, hash=False)  # a dict: not part of the hash

    @classmethod
    def resolve(cls, config: ProjectionConfig | None, record: Any = None) -> ProjectionOptions | None:
        """The options of ``config`` (None: rows stored whole); ``record``: a store's
        ``projection`` attribute, whose structure an unset ``projection.structure`` resumes with."""
        if config is None or config.dim is None:
            return None
        structure = (
            config.structure or recorded_structure(record) or ("dense" if config.per_param else DEFAULT_STRUCTURE)
        )
        get_structure(structure)  # unknown: one line
        return cls(
            structure=structure,
            dim=config.dim,
            seed=config.seed,
            kind=config.kind,
            sketch_nonzeros=config.sketch_nonzeros,
            rest=config.rest,
            allocation=config.allocation,
            low_rank=config.low_rank,
            dense_layers=tuple(config.dense_layers),
            per_param=config.per_param,
            fallback=config.structure is None and record is None,
            record=record if recorded_structure(record) == structure else None,
        )

    @property
    def spec(self) -> ProjectionStructure:
        return get_structure(self.structure)

    def finished_projector(self, slots: Sequence[ParamSlot], dim_in: int) -> RowProjector:
        """The projector of finished rows (``slots``: the row's parameters, ``dim_in`` wide): the
        structure's own, or for one that projects inside the backward and could not (the default
        on a job its engine cannot take), its stand-in's."""
        spec = self.spec
        return (get_structure(FALLBACK_STRUCTURE) if spec.in_backward else spec).finished(self, slots, dim_in)


class RowProjector(Protocol):
    """A projector of finished rows ``[n, dim_in] -> [n, out_dim]``, and the store's record of it."""

    @property
    def out_dim(self) -> int: ...

    def project(self, rows: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> dict[str, Any]: ...


class ProjectionStructure:
    """One projection structure. Subclasses set ``name`` and ``in_backward`` and implement
    ``plan`` and ``layer_sums`` (in the backward) or ``finished`` (of finished rows)."""

    name: ClassVar[str] = ""
    in_backward: ClassVar[bool] = False
    # The ``structure`` its units name (``KroneckerUnit.structure``...): the key of its
    # ``layer_sums`` with the layer rules (a structure reusing another's units shares its sums).
    unit_family: ClassVar[str] = ""

    def plan(
        self, engine: ProjectedEngine, options: ProjectionOptions, modules: dict[str, nn.Module], covered: set[str]
    ) -> Any:
        """The map of rows projected inside the backward (``KroneckerMap``, ``TensorSketchMap``):
        its units for the layers the hook path covers (``covered``), the rest after."""
        raise NotImplementedError(f"projection structure {self.name!r} does not project inside the backward")

    def layer_sums(self) -> ProjectedSums | None:
        """The per-class sums of its projected rows by layer family (``layer_rules`` calls them:
        ``outer`` always, ``embedding`` and ``entries`` where its map has units for those layers)."""
        return None

    def finished(self, options: ProjectionOptions, slots: Sequence[ParamSlot], dim_in: int) -> RowProjector:
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


STRUCTURES: Registry[ProjectionStructure] = Registry(
    "projection structure",
    unknown="projection.structure {name!r} is unknown (choices: {choices})",
    error=ConfigError,
    choices=STRUCTURE_NAMES,
)


def get_structure(name: str) -> ProjectionStructure:
    return STRUCTURES.get(name)


def recorded_structure(record: Any) -> str | None:
    """The structure a store's ``projection`` attribute was written with (None: no projection)."""
    if not isinstance(record, Mapping):
        return None
    return str(record.get("structure", "dense"))
