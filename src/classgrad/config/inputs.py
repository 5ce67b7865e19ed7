"""The sections that say what is differentiated: the model, the probe data and the loss.

Holds ``ModelConfig``, ``DataConfig`` and ``LossConfig``, with the built-in loss kinds
(``BUILTIN_LOSS_KINDS``, ``DENSE_LOSS_KINDS``) and the checkpoint suffixes a model accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Gt, Le
from pydantic import Field, Strict, field_validator
from pydantic_core import PydanticCustomError

from classgrad.config import choices
from classgrad.config.choices import LOSS_KINDS
from classgrad.config.fields import Section, StrictPositiveInt, check_import_path, check_name_or_import_path

__all__ = [
    "BUILTIN_LOSS_KINDS",
    "DENSE_LOSS_KINDS",
    "CHECKPOINT_SUFFIXES",
    "MAX_CLASSES",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
]

# Loss kinds by name: those the workers' registry holds (``choices``). The dense ones (every sample
# contributes to every class: the partitioned engine cannot compute them, so asking for it is a
# config error rather than a failure inside an actor) are ``LOSS_KINDS.with_trait("dense")``.
BUILTIN_LOSS_KINDS = LOSS_KINDS
DENSE_LOSS_KINDS = choices.DENSE_LOSS_KINDS

CHECKPOINT_SUFFIXES: tuple[str, ...] = (".pt", ".pth", ".safetensors")
# The most classes a job may have: class ids and row indices stay within int32 (zarr chunk
# indices, torch's bincount of labels); far beyond any real label set.
MAX_CLASSES = 2**31 - 1


class ModelConfig(Section):
    """The model whose per-class gradients are computed; one replica is built in each actor."""

    factory: str = Field(
        "classgrad.workers.zoo:small_cnn",
        description="Import path `module:function` of a function returning the `nn.Module`.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the factory.")
    checkpoint: str | None = Field(
        None,
        description="Weights loaded after building the model: a `.pt`/`.pth` file (read with "
        "`torch.load(weights_only=True)`, so no pickled code runs) or a `.safetensors` file; "
        "null keeps the factory's weights.",
    )
    mode: Literal["eval", "train"] = Field(
        "eval",
        description="Module mode during the gradient pass; `train` makes BatchNorm use batch "
        "statistics, which couples samples and forces the dense engine.",
    )
    output: str | Annotated[int, Strict()] | None = Field(
        None,
        description="Which entry of the model's output holds the logits when it returns a "
        "`ModelOutput`, dict or tuple: a key/attribute name, or an index. Null takes `logits` "
        "when present, else the first tensor; a tensor output is used as it is.",
    )

    @field_validator("factory")
    @classmethod
    def _factory_path(cls, value: str) -> str:
        return check_import_path(value)

    @field_validator("checkpoint")
    @classmethod
    def _checkpoint_suffix(cls, value: str | None) -> str | None:
        if value is not None and not value.lower().endswith(CHECKPOINT_SUFFIXES):
            raise PydanticCustomError(
                "checkpoint_suffix",
                "must end in {suffixes}, got {value}",
                {"suffixes": ", ".join(CHECKPOINT_SUFFIXES), "value": repr(value)},
            )
        return value


class DataConfig(Section):
    """The probe set the per-class losses are computed on."""

    factory: str = Field(
        "classgrad.workers.zoo:synthetic_probe",
        description="Import path `module:function` of a function returning a `Dataset` of "
        "`(input, target)` or of dicts (input keys and a label key, as a Hugging Face "
        "`datasets.Dataset.with_format('torch')` gives), a `DataLoader` (its dataset and "
        "`collate_fn` are used, its sampler, shuffling and batch size are not), or a pair of "
        "tensors `(inputs, targets)`.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the factory.")
    batch_size: StrictPositiveInt = Field(256, description="Probe samples per forward pass (micro-batch).")
    # Not `label_key`: config keys with the word "key" are redacted as secrets in the stored config.
    label_field: str | None = Field(
        None,
        description="The key of the label in dict samples; null takes the first of `labels`, "
        "`label` that the samples have. The label is never passed to the model; the other keys "
        "are passed as keyword arguments when the model's `forward` takes them.",
    )
    collate: str = Field(
        "stack",
        description="How samples become a batch: `stack` (every sample's tensors of one shape), "
        "`pad` (variable-length tensors padded at the end to the longest of each batch, with "
        "`pad_values`), or an import path `module:function` of a function taking a list of samples.",
    )
    pad_values: dict[str, float] = Field(
        default_factory=dict,
        description="With `collate: pad`, the pad value per dict key (default 0, which "
        "`attention_mask` reads as hidden; `input_ids` by default the model's "
        "`config.pad_token_id`, and another pad id for it is refused).",
    )

    @field_validator("collate")
    @classmethod
    def _collate_kind(cls, value: str) -> str:
        message = "must be stack, pad or an import path 'module:function', got {value}"
        return check_name_or_import_path(value, ("stack", "pad"), "collate", message)

    @field_validator("factory")
    @classmethod
    def _factory_path(cls, value: str) -> str:
        return check_import_path(value)


class LossConfig(Section):
    """The per-class loss vector L(θ) = (L_0 … L_{C-1}); row c of the store is ∂L_c/∂θ."""

    kind: str = Field(
        "cross_entropy",
        description="A built-in kind (`cross_entropy`: mean CE of the samples labelled c, "
        "class-partitioned; `logit`: mean of output column c, dense; `bce`: one-vs-rest BCE on "
        "multi-hot targets, dense) or an import path `module:function` of either a function "
        "`(outputs, targets) -> [C]` giving per-class means over the samples it is given "
        "(dense), or a per-sample loss `(outputs, labels) -> [n]` marked with "
        "`@classgrad.workers.losses.partitioned_loss` (class-partitioned: L_c is its mean over class c).",
    )
    num_classes: Annotated[int, Strict(), Gt(0), Le(MAX_CLASSES)] = Field(
        description="C, the number of classes (rows of the store); the model's output must have "
        "C columns. Required: it fixes the store's shape, so it is never guessed.",
    )

    @field_validator("kind")
    @classmethod
    def _kind_name_or_path(cls, value: str) -> str:
        message = "unknown loss kind {value} (choices: {choices}, or an import path 'module:function')"
        return check_name_or_import_path(value, tuple(sorted(LOSS_KINDS)), "loss_kind", message)
