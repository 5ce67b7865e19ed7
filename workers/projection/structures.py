"""The projection structures: which ones exist, which is the default, and what a store recorded.

Holds ``Structure`` (a structure's name, whether it projects inside the backward, and for those
that do not, how to build the projector of finished rows), ``STRUCTURES`` with
``register_structure`` / ``create_row_projector``, ``DEFAULT_STRUCTURE`` (what a ``projection``
section with only ``dim`` means for a new store), ``FALLBACK_STRUCTURE`` (the default's stand-in
where the hook path cannot take a job), ``recorded_structure`` and ``resolve_structure``, and what
the analysis commands say of a store's rows: ``structure_label`` and ``neighbour_caveat``; and
``check_width``, the one refusal of a ``dim`` wider than the row.

A structure projecting inside the backward has its engine registered beside the engines
(``classgrad.workers.engines.PROJECTED_ENGINES``, same names): the projection package never
imports the engines.

Old stores: ``projection.structure`` unset resolves to what the store recorded (a dense store's
record has no ``structure`` key: it was made before structures existed, or by the old default),
so a store made under an earlier default resumes with the map it was written with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from classgrad.config.choices import STRUCTURES as STRUCTURE_NAMES
from classgrad.errors import ConfigError
from classgrad.store.params import ParamSlot
from classgrad.workers.projection.chunked_sketch import HASHED
from classgrad.workers.projection.dense import Projector
from classgrad.workers.projection.sketch import RowSketch

DEFAULT_STRUCTURE = "tensorsketch"
FALLBACK_STRUCTURE = "sketch"

RowProjectorFactory = Callable[[Any, Sequence[ParamSlot], int], Any]


@dataclass(frozen=True)
class Structure:
    """``in_backward``: rows projected by the engine's hook path (an engine registered under the
    same name); else ``finished`` builds the projector of finished rows from ``(projection
    config, slots, row width)``."""

    name: str
    in_backward: bool
    finished: RowProjectorFactory | None = None


STRUCTURES: dict[str, Structure] = {}


def register_structure(structure: Structure, *, replace: bool = False) -> None:
    if not replace and structure.name in STRUCTURES:
        raise ValueError(f"projection structure {structure.name!r} is already registered")
    if not structure.in_backward and structure.finished is None:
        raise ValueError(f"projection structure {structure.name!r} needs a projector of finished rows")
    STRUCTURES[structure.name] = structure
    STRUCTURE_NAMES.add(structure.name, *(("in_backward",) if structure.in_backward else ()))  # a job file may name it


def _dense(p: Any, slots: Sequence[ParamSlot], dim_in: int) -> Projector:
    groups = [(s.offset, s.size) for s in slots] if p.per_param else None
    return Projector(dim_in, p.dim, kind=p.kind, seed=p.seed, groups=groups)


def _sketch(p: Any, slots: Sequence[ParamSlot], dim_in: int) -> RowSketch:
    return RowSketch(dim_in, p.dim, nonzeros=p.sketch_nonzeros, seed=p.seed)


register_structure(Structure("dense", False, _dense))
register_structure(Structure("sketch", False, _sketch))
register_structure(Structure("kronecker", True))
register_structure(Structure("tensorsketch", True))


def get_structure(name: str) -> Structure:
    try:
        return STRUCTURES[name]
    except KeyError:
        raise ConfigError(
            f"projection.structure {name!r} is unknown (choices: {', '.join(sorted(STRUCTURES))})"
        ) from None


def recorded_structure(record: Any) -> str | None:
    """The structure a store's ``projection`` attribute was written with (None: no projection)."""
    if not isinstance(record, dict):
        return None
    return str(record.get("structure", "dense"))


def check_width(dim: int, row_width: int) -> None:
    """Refuse a ``projection.dim`` larger than the row it projects, whatever the structure (the
    stored row would be wider than the row itself): one message for every place that checks."""
    if dim > row_width:
        raise ConfigError(
            f"projection.dim ({dim}) is larger than the row it projects ({row_width} columns): lower "
            f"projection.dim, or store full rows (projection.dim: null)"
        )


def structure_label(record: Any) -> str:
    """A store's rows in a few words, from its ``projection`` record ("tensorsketch, chunked
    placement"; "full rows" without one)."""
    name = recorded_structure(record)
    if name is None:
        return "full rows"
    if name == "tensorsketch":
        return f"tensorsketch, {record.get('placement', HASHED)} placement"
    return name


def neighbour_caveat(record: Any) -> str | None:
    """What to tell a user who ranks the classes of a store whose rows may hold false neighbours
    (None: nothing): a tensorsketch store made before the chunked placement (issue 44)."""
    if recorded_structure(record) != "tensorsketch" or record.get("placement", HASHED) != HASHED:
        return None
    return (
        "its rows are a hashed tensorsketch (stores made before 2026-12-04), where two classes whose "
        "head rows share a hash bucket look alike: its nearest neighbours may hold hash collisions "
        "(at 10,000 classes and dim 4,096, most classes have one). Rebuild it with the current default "
        "(chunked placement): rerun its job with --set store.overwrite=true"
    )


def resolve_structure(configured: str | None, record: Any = None, *, per_param: bool = False) -> str:
    """The structure a job runs: the configured one; unset, the store's recorded one, else the
    default (dense with ``per_param``, which only a dense projection has)."""
    if configured is not None:
        return configured
    return recorded_structure(record) or ("dense" if per_param else DEFAULT_STRUCTURE)


def create_row_projector(structure: str, projection: Any, slots: Sequence[ParamSlot], dim_in: int) -> Any:
    """The projector of finished rows of ``structure`` (None for one that projects in the backward)."""
    spec = get_structure(structure)
    return None if spec.in_backward else spec.finished(projection, slots, dim_in)  # type: ignore[misc]
