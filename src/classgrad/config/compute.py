"""The sections that say how rows are computed: precision, parameter selection, engine, projection.

Holds ``PrecisionConfig``, ``ParamsConfig``, ``EngineConfig`` and ``ProjectionConfig``; and
precision's choices, defaults and scale check (``PRECISION_DTYPES``, ``DEFAULT_*``,
``scales_in_order``), which ``classgrad.workers.amp.PrecisionPolicy`` shares.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from classgrad.config.choices import ENGINE_KINDS, PROJECTION_KINDS, STRUCTURES
from classgrad.config.fields import (
    DEVICE_RE,
    PositiveFloat32,
    Section,
    StrictNonNegativeInt,
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
    "ProjectionConfig",
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


class ProjectionConfig(Section):
    """Optional random projection of each row to `dim` columns (Johnson–Lindenstrauss)."""

    dim: StrictPositiveInt | None = Field(
        None, description="k, the stored row length; null = store full rows (no projection)."
    )
    kind: Annotated[str, PROJECTION_KINDS] = Field(
        "rademacher",
        description="Distribution of the random matrix's entries: random signs or Gaussian.",
    )
    seed: StrictNonNegativeInt = Field(
        0,
        description="Seed of the projection; the matrix is regenerated block by block from it, "
        "identically on every worker.",
    )
    per_param: bool = Field(
        False,
        description="Use a separate projection for each selected parameter instead of one over the whole row.",
    )
    structure: Annotated[str, STRUCTURES] | None = Field(
        None,
        description="null (the default): tensorsketch for a new store where the partitioned engine's "
        "hook path takes the job (else sketch, said in the run's notes), and what the store recorded "
        "when it resumes one (a store made before this default, with only `dim`, is dense). "
        "tensorsketch: one sketch of the whole row that follows each layer's outer product, formed "
        "inside the backward: Linear, Conv1d/2d/3d, Embedding, EmbeddingBag and transformers' Conv1D "
        "layers (the classifier head above all) never form a full row; each layer's rows and columns "
        "are placed without collisions in chunks of dim, chunks mixed by random-phase filters, so no "
        "two classes' head rows share their columns; the other parameters sketched into the same "
        "columns (`sketch_nonzeros` per entry); over all C classes its nearest neighbours and worst "
        "pairs are those of a CountSketch of the exact rows (stores made before 2026-12-04 hold a "
        "hashed placement whose neighbours may be collisions: `classgrad inspect` says which). "
        "dense: each finished row times a k-column random matrix (2 D k flops per row). kronecker: "
        "those layers projected as P_out W P_in^T inside the "
        "backward, the other parameters as `rest` says (fast, but far noisier where a class's "
        "gradient has low rank: heads, few samples). sketch: each finished row by a sparse sign "
        "sketch (s D additions per row; `kind` does not apply to it).",
    )
    rest: Literal["dense", "keep", "sketch"] = Field(
        "sketch",
        description="structure=kronecker: parameters outside the Kronecker layers (norms, position "
        "embeddings, grouped convolutions, low-rank layers) projected by a sparse sign sketch (sketch: each "
        "parameter added with a random sign to `sketch_nonzeros` columns, one per block of the "
        "rest's columns; `kind` does not apply to it), densely (dense: 2 k flops per parameter, "
        "a thinner error tail where a head's bias dominates the rows), or stored whole (keep). "
        "Stores made before sketch was the default (dense) resume with rest: dense set.",
    )
    sketch_nonzeros: StrictPositiveInt = Field(
        4,
        description="structure=sketch, rest=sketch, or the parameters structure=tensorsketch sketches after the "
        "backward (norms, raw parameters; its layers' entries are placed, not hashed): columns each entry is "
        "sent to (s; at most the width it is sketched to). Cost grows as s, the error's tail for rows "
        "concentrated on few parameters shrinks with it.",
    )
    allocation: Literal["norm", "size"] = Field(
        "norm",
        description="structure=kronecker: how dim is split among layers: in proportion to each layer's "
        "squared gradient norm measured on the first 32 classes (norm, recorded in the store) or to "
        "its parameter count (size).",
    )

    low_rank: Literal["dense", "kronecker"] = Field(
        "dense",
        description="structure=kronecker: layers that see one token per sample (a classifier head, a "
        "pooler: per-class gradients of rank at most the class's sample count, where a Kronecker "
        "projection is far noisier than a dense one) join the rest (dense), found on the first 32 "
        "classes and recorded; or are projected like the others (kronecker).",
    )
    dense_layers: list[str] = Field(
        default_factory=list,
        description="structure=kronecker: module name patterns (fnmatch) of more layers left to the rest.",
    )

    @field_validator("kind")
    @classmethod
    def _registered_projection_kind(cls, value: str) -> str:
        return PROJECTION_KINDS.check(value)

    @field_validator("structure")
    @classmethod
    def _registered_structure(cls, value: str | None) -> str | None:
        return None if value is None else STRUCTURES.check(value)

    @model_validator(mode="after")
    def _kronecker(self) -> ProjectionConfig:
        if self.structure not in ("dense", None) and self.per_param:
            raise ValueError(
                f"projection.per_param applies to structure=dense only ({self.structure} is not per parameter)"
            )
        return self
