"""Shared pieces of the config sections: the section base, bounded number types, syntax checks.

Holds:

- ``Section``: the base of every section (unknown keys are errors, values frozen once validated);
- ``PositiveFiniteFloat``/``NonNegativeFiniteFloat``/``StrictPositiveInt``/``StrictNonNegativeInt``:
  the bounded number field types (a bool is never a number: ``batch_size: true`` is refused);
- ``canonical_import_path`` (pre-namespace ``workers.``/``service.`` prefixes rewritten) and
  ``check_import_path`` (that, then the ``module:function`` syntax);
- the syntax of torch devices and Ray addresses (``DEVICE_RE``, ``ADDRESS_RE``).

Only syntax is checked here: an import happens in the actor, where the module has to exist.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from annotated_types import Ge, Gt
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

__all__ = [
    "ADDRESS_RE",
    "DEVICE_RE",
    "FLOAT32_MAX",
    "Float32Number",
    "MAX_MIB",
    "MemoryMiB",
    "NonNegativeFiniteFloat",
    "PositiveFiniteFloat",
    "PositiveFloat32",
    "Section",
    "StrictNonNegativeInt",
    "StrictPositiveInt",
    "canonical_import_path",
    "check_import_path",
]

# "package.module:function" or "module:Class.attr".
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH_RE = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
DEVICE_RE = re.compile(r"^(cpu|cuda|mps)(:\d+)?$")
# Ray addresses ray.init accepts: "auto", "local", a Ray client URL, or the GCS "host:port".
ADDRESS_RE = re.compile(r"^(auto|local|ray://\S+|(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):\d{1,5})$")


def _not_a_bool(value: Any) -> Any:
    # YAML reads `yes`/`true` as a bool, and pydantic would take it as 1 or 1.0.
    if isinstance(value, bool):
        raise PydanticCustomError(
            "bool_not_number", "must be a number, got a bool ({value})", {"value": str(value).lower()}
        )
    return value


# Strict: a bool (`batch_size: true`), a float (`4.0`) or a string is refused, never read as an int.
StrictPositiveInt = Annotated[int, Strict(), Gt(0)]
StrictNonNegativeInt = Annotated[int, Strict(), Ge(0)]
PositiveFiniteFloat = Annotated[float, BeforeValidator(_not_a_bool), Field(gt=0, allow_inf_nan=False)]
NonNegativeFiniteFloat = Annotated[float, BeforeValidator(_not_a_bool), Field(ge=0, allow_inf_nan=False)]
# A number that multiplies float32 values (a score's weight): finite float64 beyond float32's range
# (1e308) overflows there, so it is refused here, naming the option, instead.
FLOAT32_MAX = 3.4028234663852886e38


def _within_float32(value: float) -> float:
    if abs(value) > FLOAT32_MAX:
        raise PydanticCustomError("float32_range", "must be within float32's range (|x| <= 3.4e38)")
    return value


Float32Number = Annotated[
    float, BeforeValidator(_not_a_bool), Field(allow_inf_nan=False), AfterValidator(_within_float32)
]
# A scale that multiplies a float32 loss (fp16's loss scale): positive and within float32's range.
PositiveFloat32 = Annotated[
    float, BeforeValidator(_not_a_bool), Field(gt=0, allow_inf_nan=False), AfterValidator(_within_float32)
]
# A memory budget in MiB: a finite one beyond a pebibyte (1e308 MiB) overflowed the byte count
# its plan takes (an internal error), so it is refused here, naming the option.
MAX_MIB = float(1 << 30)
MemoryMiB = Annotated[float, BeforeValidator(_not_a_bool), Field(gt=0, le=MAX_MIB, allow_inf_nan=False)]

# Import paths written before classgrad had one namespace (`workers.zoo:mlp`): accepted and
# rewritten to today's module, so old job files (and the configs recorded in old stores) still work.
_LEGACY_PREFIXES = (("workers.", "classgrad.workers."), ("service.", "classgrad.service."))


def canonical_import_path(value: str) -> str:
    """``value`` with a pre-namespace module prefix (``workers.``/``service.``) rewritten."""
    for old, new in _LEGACY_PREFIXES:
        if value.startswith(old):
            return new + value[len(old) :]
    return value


def check_import_path(value: str) -> str:
    """``value`` canonicalised; a ``PydanticCustomError`` unless it reads ``module:function``."""
    value = canonical_import_path(value)
    if not _IMPORT_PATH_RE.match(value):
        raise PydanticCustomError(
            "import_path",
            "must be an import path 'module:function' (e.g. 'classgrad.workers.zoo:small_cnn'), got {value}",
            {"value": repr(value)},
        )
    return value


def check_name_or_import_path(value: str, names: tuple[str, ...], error: str, message: str) -> str:
    """``value`` when it is one of ``names``, canonicalised when it is a ``module:function`` path;
    else a ``PydanticCustomError`` of type ``error`` with ``message`` (``{value}``, ``{choices}``)."""
    if ":" in value:
        return check_import_path(value)
    if value not in names:
        raise PydanticCustomError(error, message, {"value": repr(value), "choices": ", ".join(names)})
    return value


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are fixed once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
