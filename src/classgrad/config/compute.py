"""The sections that say how rows are computed: precision, parameter selection, engine (projection:
``classgrad.config.projection``).

Holds ``PrecisionConfig``, ``ParamsConfig`` and ``EngineConfig``; and
precision's choices, defaults and scale check (``PRECISION_DTYPES``, ``DEFAULT_*``,
``scales_in_order``), which ``classgrad.workers.amp.PrecisionPolicy`` shares.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from classgrad.config.choices import ENGINE_KINDS
from classgrad.config.fields import (
    DEVICE_RE,
    PositiveFloat32,
    Section,
    StrictPositiveInt,
)

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_INIT_SCALE",
    "DEFAULT_MIN_SCALE",
    "PRECISION_DTYPES",
    "EngineConfig",
    "ParamsConfig",
    "PrecisionConfig",
    "PrecisionDtype",
    "scales_in_order",
]

# Precision, once for the job file's section and for the policy the engines run with
# (classgrad.workers.amp.PrecisionPolicy).
PrecisionDtype = Literal["fp32", "fp16", "bf16"]
PRECISION_DTYPES: tuple[str, ...] = get_args(PrecisionDtype)
DEFAULT_DTYPE: PrecisionDtype = "fp32"
DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_MIN_SCALE = 1.0


def scales_in_order(init_scale: float, min_scale: float) -> bool:
    """fp16's loss-scale schedule can run: it starts at ``init_scale`` and halves the scale of a row
    that overflows, down to ``min_scale``; so ``0 < min_scale <= init_scale``."""
    return 0 < min_scale <= init_scale


class PrecisionConfig(Section):
    """Arithmetic precision of the forward/backward pass (parameters and rows stay as asked)."""

    dtype: PrecisionDtype = Field(
        DEFAULT_DTYPE,
        description="`fp32` (float32 on a GPU too: TF32 off while rows are computed), or `fp16`/`bf16` "
        "under `torch.autocast`; fp16 uses loss scaling.",
    )
    init_scale: PositiveFloat32 = Field(
        DEFAULT_INIT_SCALE,
        description="fp16 only: loss scale S the backward starts with; rows are divided by S "
        "and a row that overflows is recomputed with S halved.",
    )
    min_scale: PositiveFloat32 = Field(
        DEFAULT_MIN_SCALE,
        description="fp16 only: smallest scale tried before a row that is still non-finite "
        "fails the job (naming the class); at most `init_scale`.",
    )


class ParamsConfig(Section):
    """Which parameters form the columns of a row (in `model.named_parameters()` order)."""

    include: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of parameter names to keep; empty = every parameter with `requires_grad`.",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of parameter names to drop (applied after `include`).",
    )


class EngineConfig(Section):
    """How rows are computed inside one actor."""

    kind: Annotated[str, ENGINE_KINDS] = Field(
        "auto",
        description="`partitioned` (one forward+backward per class's samples), `dense` "
        "(block VJPs from one forward per micro-batch), `reference` (slow per-class loop, for "
        "checking), or `auto`: partitioned when the loss is class-partitioned and the model "
        "treats samples independently, dense otherwise.",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules imported, in order, before the job file is checked, on the driver and in "
        "every actor: where the job's own engines, losses and projection structures are registered "
        "(`register_engine`, `register_loss`, `register_structure`), so that their names are valid here.",
    )
    block_rows: StrictPositiveInt | None = Field(
        None,
        description="Rows per VJP block of the dense engine (the graph is kept while one block "
        "runs); null = chosen by a short measurement. Not used when rows go through the model's "
        "final Linear layer (a loss linear in the outputs: see the dense engine).",
    )
    group_rows: StrictPositiveInt = Field(
        256,
        description="Rows accumulated at once over the micro-batches of the probe set (bounds "
        "the memory of the row accumulator: group_rows × D floats).",
    )
    device: str | None = Field(
        None,
        description="Torch device of each actor (`cpu`, `cuda`, `cuda:N`, `mps`); null = `cuda` "
        "when `cluster.num_gpus_per_worker` > 0, else `cpu`.",
    )

    @field_validator("kind")
    @classmethod
    def _registered_kind(cls, value: str) -> str:
        return ENGINE_KINDS.check(value)

    @field_validator("device")
    @classmethod
    def _device_syntax(cls, value: str | None) -> str | None:
        if value is not None and not DEVICE_RE.match(value):
            raise PydanticCustomError(
                "device",
                "must be cpu, cuda, cuda:N or mps, got {value}",
                {"value": repr(value)},
            )
        return value
