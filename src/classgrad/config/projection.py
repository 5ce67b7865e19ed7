"""The job's ``projection`` section: the keys every structure shares, and each structure's own
options, told apart by ``structure`` (a union discriminated by the structure's name, open to
plugins).

Holds:

- ``ProjectionConfig``: ``dim``, ``seed`` and ``structure``. Validating one (a job file's
  section, ``--set``, a store's recorded config) gives the options model its structure
  registered, a subclass with the structure's own keys (``structure`` unset: the model registered
  for ``None``, the keys of the structures unset can mean). A key of another structure is refused
  in one line naming the structure, unless it holds that structure's default (configs recorded
  before each structure had its own options hold every key). Nothing mirrors it: a structure
  reads the options it validated.
- ``register_projection_options`` / ``projection_options_model`` / ``projection_options_models``:
  the table of options models, filled by each structure's registration
  (``classgrad.workers.projection.register_structure``); the config does not import the
  structures, so the first lookup asks ``choices`` to load the built-ins.
- ``ProjectionKind``, ``DEFAULT_KIND`` and ``DEFAULT_SKETCH_NONZEROS``: keys several structures'
  options declare, their defaults stated once.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, ModelWrapValidatorHandler, field_validator, model_validator
from pydantic_core import PydanticCustomError

from classgrad.config.choices import PROJECTION_KINDS, STRUCTURES
from classgrad.config.fields import Section, StrictNonNegativeInt, StrictPositiveInt

__all__ = [
    "DEFAULT_KIND",
    "DEFAULT_SKETCH_NONZEROS",
    "ProjectionConfig",
    "STRUCTURE_KEY_ERROR",
    "ProjectionKind",
    "projection_keys",
    "projection_options_model",
    "projection_options_models",
    "register_projection_options",
]

DEFAULT_KIND = "rademacher"
DEFAULT_SKETCH_NONZEROS = 4
# The distribution of a map's random entries (a registry-backed name: ``register_projection``).
ProjectionKind = Annotated[str, PROJECTION_KINDS, AfterValidator(PROJECTION_KINDS.check)]

# The error of a key the section's structure lacks (its context names the key).
STRUCTURE_KEY_ERROR = "structure_key"
# Structure name (None: unset) -> its options model; filled by the structures' registration.
_OPTIONS: dict[str | None, type[ProjectionConfig]] = {}


class ProjectionConfig(Section):
    """Optional random projection of each row to `dim` columns (Johnson–Lindenstrauss). These keys
    are every structure's; each structure's own keys are in its table below."""

    dim: StrictPositiveInt | None = Field(
        None, description="k, the stored row length; null = store full rows (no projection)."
    )
    seed: StrictNonNegativeInt = Field(
        0,
        description="Seed of the projection; the random entries are regenerated from it, identically on every worker.",
    )
    structure: Annotated[str, STRUCTURES] | None = Field(
        None,
        description="The map (each structure's table below says what it does and its keys). null (the "
        "default): tensorsketch for a new store where the partitioned engine's hook path takes the job "
        "(else sketch, said in the run's notes), and what the store recorded when it resumes one (a store "
        "made before this default, with only `dim`, is dense); its keys are those of dense, sketch and "
        "tensorsketch.",
    )

    @field_validator("structure")
    @classmethod
    def _registered_structure(cls, value: str | None) -> str | None:
        return None if value is None else STRUCTURES.check(value)

    @model_validator(mode="wrap")
    @classmethod
    def _as_its_structure(cls, data: Any, handler: ModelWrapValidatorHandler[ProjectionConfig]) -> ProjectionConfig:
        """The section validated by its structure's options model."""
        if not isinstance(data, dict):
            return handler(data)
        structure = data.get("structure")
        if structure is not None and (not isinstance(structure, str) or structure not in STRUCTURES):
            return handler(data)  # the field's own error names the choices
        model = projection_options_model(structure)
        if cls is not ProjectionConfig and not issubclass(model, cls):
            raise PydanticCustomError(
                "structure_options",
                "{model} holds the options of another structure than {structure}",
                {"model": cls.__name__, "structure": structure or "unset"},
            )
        data = _without_inert_keys(data, model)
        foreign = [key for key in data if key not in model.model_fields]
        if foreign:  # the loader reads ``key`` to name projection.<key>
            raise PydanticCustomError(
                STRUCTURE_KEY_ERROR,
                "unknown key (choices: {own}) of structure {structure}",
                {"key": foreign[0], "structure": structure or "unset", "own": ", ".join(sorted(model.model_fields))},
            )
        return handler(data) if model is cls else model.model_validate(data)


def _without_inert_keys(data: dict[str, Any], model: type[ProjectionConfig]) -> dict[str, Any]:
    """``data`` less the keys ``model`` lacks that hold another structure's default for them (a
    config recorded before each structure had its own options holds them all)."""
    inert: dict[str, list[Any]] = {}
    for other in _OPTIONS.values():
        for key, info in other.model_fields.items():
            if key not in model.model_fields and not info.is_required():  # a default_factory's too
                inert.setdefault(key, []).append(info.get_default(call_default_factory=True))
    return {k: v for k, v in data.items() if not (k in inert and v in inert[k])}


def register_projection_options(structure: str | None, model: type[ProjectionConfig]) -> None:
    """``model`` validates a ``projection`` section naming ``structure`` (None: unset)."""
    if not (isinstance(model, type) and issubclass(model, ProjectionConfig)):
        raise TypeError(f"the options of structure {structure!r} must subclass ProjectionConfig, got {model!r}")
    _OPTIONS[structure] = model


def projection_options_model(structure: str | None) -> type[ProjectionConfig]:
    """The options model of ``structure`` (``ProjectionConfig`` itself where none is registered)."""
    STRUCTURES.names()  # the built-ins' registration, once
    return _OPTIONS.get(structure, ProjectionConfig)


def projection_options_models() -> dict[str | None, type[ProjectionConfig]]:
    """Every registered structure's options model (None: unset), in registration order."""
    names = STRUCTURES.names()
    return {k: v for k, v in _OPTIONS.items() if k is None or k in names}


def projection_keys() -> set[str]:
    """Every key some structure's options declare (what a ``--set projection.<key>`` may name
    before the section's structure is known)."""
    return {key for model in projection_options_models().values() for key in model.model_fields}
