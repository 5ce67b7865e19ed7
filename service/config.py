"""The typed job config: what one ``classgrad run`` computes, where it stores it, how it runs.

Holds:

- one pydantic model per section of the job file (``ModelConfig``, ``DataConfig``,
  ``LossConfig``, ``PrecisionConfig``, ``ParamsConfig``, ``EngineConfig``, ``ShardingConfig``,
  ``StoreConfig``, ``ClusterConfig``, ``ProjectionConfig``, ``RunConfig``) and ``JobConfig``,
  which holds them all and does the cross-field checks; the defaults live here and nowhere else;
- ``JobConfig.fingerprint()`` (what makes two stores interchangeable) and
  ``JobConfig.redacted()`` (the config as written into the store, secrets hidden);
- ``load_config``: YAML file + ``--set a.b=c`` overrides -> ``JobConfig``, every problem a
  ``ConfigError`` with one line that names the field;
- ``config_reference_markdown``: the README's config reference, generated from the field
  descriptions so that it cannot drift from the code.

Nothing here imports torch, Ray or ``workers``: a config is checked (syntax of import paths
included) before anything heavy is loaded, and the CLI can reject a bad file instantly.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from classgrad.service.errors import ConfigError

__all__ = [
    "BUILTIN_LOSS_KINDS",
    "DENSE_LOSS_KINDS",
    "ClusterConfig",
    "DataConfig",
    "EngineConfig",
    "JobConfig",
    "LossConfig",
    "ModelConfig",
    "ParamsConfig",
    "PrecisionConfig",
    "ProjectionConfig",
    "RunConfig",
    "ShardingConfig",
    "StoreConfig",
    "config_reference_markdown",
    "load_config",
]

# Loss kinds the workers' registry provides by name. Kept here (not imported from workers) so the
# config can be checked without torch; the loss registry should assert that it knows all of them.
BUILTIN_LOSS_KINDS: tuple[str, ...] = ("bce", "cross_entropy", "logit")
# Built-in kinds where every sample contributes to every class: the partitioned engine cannot
# compute them, so asking for it is a config error rather than a failure inside an actor.
DENSE_LOSS_KINDS: frozenset[str] = frozenset({"bce", "logit"})

CHECKPOINT_SUFFIXES: tuple[str, ...] = (".pt", ".pth", ".safetensors")

# "package.module:function" or "module:Class.attr"; only syntax is checked here, the import
# happens in the actor (where the module actually has to exist).
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH_RE = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
_DEVICE_RE = re.compile(r"^(cpu|cuda|mps)(:\d+)?$")
# Ray addresses ray.init accepts: "auto", "local", a Ray client URL, or the GCS "host:port".
_ADDRESS_RE = re.compile(r"^(auto|local|ray://\S+|(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):\d{1,5})$")
# Keys whose values are treated as secrets when the config is written anywhere.
_SECRET_RE = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)
_REDACTED = "***"

PositiveFiniteFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFiniteFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


# Import paths written before classgrad had one namespace (`workers.zoo:mlp`): accepted and
# rewritten to today's module, so old job files (and the configs recorded in old stores) still work.
_LEGACY_PREFIXES = (("workers.", "classgrad.workers."), ("service.", "classgrad.service."))


def canonical_import_path(value: str) -> str:
    """``value`` with a pre-namespace module prefix (``workers.``/``service.``) rewritten."""
    for old, new in _LEGACY_PREFIXES:
        if value.startswith(old):
            return new + value[len(old):]
    return value


def _check_import_path(value: str) -> str:
    value = canonical_import_path(value)
    if not _IMPORT_PATH_RE.match(value):
        raise PydanticCustomError(
            "import_path",
            "must be an import path 'module:function' (e.g. 'classgrad.workers.zoo:small_cnn'), got {value}",
            {"value": repr(value)},
        )
    return value


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, values are fixed once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The model whose per-class gradients are computed; one replica is built in each actor."""

    factory: str = Field(
        "classgrad.workers.zoo:small_cnn",
        description="Import path `module:function` of a function returning the `nn.Module`.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the factory."
    )
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

    @field_validator("factory")
    @classmethod
    def _factory_path(cls, value: str) -> str:
        return _check_import_path(value)

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


class DataConfig(_Section):
    """The probe set the per-class losses are computed on."""

    factory: str = Field(
        "classgrad.workers.zoo:synthetic_probe",
        description="Import path `module:function` of a function returning a `Dataset` of "
        "`(input, target)` or a pair of tensors `(inputs, targets)`.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the factory."
    )
    batch_size: PositiveInt = Field(
        256, description="Probe samples per forward pass (micro-batch)."
    )

    @field_validator("factory")
    @classmethod
    def _factory_path(cls, value: str) -> str:
        return _check_import_path(value)


class LossConfig(_Section):
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
    num_classes: PositiveInt = Field(
        description="C, the number of classes (rows of the store); the model's output must have "
        "C columns. Required: it fixes the store's shape, so it is never guessed.",
    )

    @field_validator("kind")
    @classmethod
    def _kind_name_or_path(cls, value: str) -> str:
        if ":" in value:
            return _check_import_path(value)
        if value not in BUILTIN_LOSS_KINDS:
            raise PydanticCustomError(
                "loss_kind",
                "unknown loss kind {value} (choices: {choices}, or an import path "
                "'module:function')",
                {"value": repr(value), "choices": ", ".join(BUILTIN_LOSS_KINDS)},
            )
        return value


class PrecisionConfig(_Section):
    """Arithmetic precision of the forward/backward pass (parameters and rows stay as asked)."""

    dtype: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32",
        description="`fp32`, or `fp16`/`bf16` under `torch.autocast`; fp16 uses loss scaling.",
    )
    init_scale: PositiveFiniteFloat = Field(
        65536.0,
        description="fp16 only: loss scale S the backward starts with; rows are divided by S "
        "and a row that overflows is recomputed with S halved.",
    )
    min_scale: PositiveFiniteFloat = Field(
        1.0,
        description="fp16 only: smallest scale tried before a row that is still non-finite "
        "fails the job (naming the class); at most `init_scale`.",
    )


class ParamsConfig(_Section):
    """Which parameters form the columns of a row (in `model.named_parameters()` order)."""

    include: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of parameter names to keep; empty = every parameter "
        "with `requires_grad`.",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of parameter names to drop (applied after `include`).",
    )


class EngineConfig(_Section):
    """How rows are computed inside one actor."""

    kind: Literal["auto", "partitioned", "dense", "reference"] = Field(
        "auto",
        description="`partitioned` (one forward+backward per class's samples), `dense` "
        "(block VJPs from one forward per micro-batch), `reference` (slow per-class loop, for "
        "checking), or `auto`: partitioned when the loss is class-partitioned and the model "
        "treats samples independently, dense otherwise.",
    )
    block_rows: PositiveInt | None = Field(
        None,
        description="Rows per VJP block of the dense engine (the graph is kept while one block "
        "runs); null = chosen by a short measurement. Not used when rows go through the model's "
        "final Linear layer (a loss linear in the outputs: see the dense engine).",
    )
    group_rows: PositiveInt = Field(
        256,
        description="Rows accumulated at once over the micro-batches of the probe set (bounds "
        "the memory of the row accumulator: group_rows × D floats).",
    )
    device: str | None = Field(
        None,
        description="Torch device of each actor (`cpu`, `cuda`, `cuda:N`, `mps`); null = `cuda` "
        "when `cluster.num_gpus_per_worker` > 0, else `cpu`.",
    )

    @field_validator("device")
    @classmethod
    def _device_syntax(cls, value: str | None) -> str | None:
        if value is not None and not _DEVICE_RE.match(value):
            raise PydanticCustomError(
                "device",
                "must be cpu, cuda, cuda:N or mps, got {value}",
                {"value": repr(value)},
            )
        return value


class ShardingConfig(_Section):
    """How the classes are cut into work units handed to actors."""

    shard_rows: PositiveInt = Field(
        256,
        description="Classes (rows) per shard; a multiple of `store.row_chunk` so that no two "
        "actors ever write the same chunk. The last shard may be shorter.",
    )
    max_attempts: PositiveInt = Field(
        3,
        description="Attempts per shard (first try included) before the job fails naming the "
        "shard; completed shards are kept.",
    )


class StoreConfig(_Section):
    """The Zarr store the rows are written to (see DESIGN.md, "Store format")."""

    url: str = Field(
        "./stores/demo.zarr",
        min_length=1,
        description="Where the store lives: a path, `file://…`, `s3://bucket/path` or "
        "`memory://…`.",
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Stored row dtype; float16/bfloat16 rows are stored with a per-row scale "
        "(bfloat16 as its uint16 bits).",
    )
    row_chunk: PositiveInt = Field(16, description="Rows per chunk of `grads`.")
    col_chunk: PositiveInt = Field(
        1048576, description="Columns per chunk of `grads` (capped at the row length)."
    )
    codec: Literal["none", "zstd", "blosc"] = Field(
        "none",
        description="Compression of `grads` chunks (dense gradients barely compress); every "
        "chunk also gets a crc32c checksum.",
    )
    sharded: bool = Field(
        False,
        description="Use Zarr's sharding codec: one storage object per work shard and column "
        "block (fewer, larger objects on object storage).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for the store's filesystem (e.g. `endpoint_url`, "
        "`client_kwargs`); values under secret-looking keys are never written into the store.",
    )
    overwrite: bool = Field(
        False,
        description="Replace an existing store made by another config instead of refusing it "
        "(a store with the same fingerprint is resumed either way).",
    )


class ClusterConfig(_Section):
    """Where the actors run and what each one reserves."""

    address: str | None = Field(
        None,
        description="null = start a local Ray (`ray.init()`), or join the cluster named by "
        "`RAY_ADDRESS` when that is set (as inside a Ray job); `auto`, `ray://host:port` or the "
        "GCS `host:port` joins a running cluster.",
    )
    num_workers: PositiveInt = Field(2, description="Number of actors (model replicas).")
    num_gpus_per_worker: NonNegativeFiniteFloat = Field(
        0.0,
        description="GPUs reserved by each actor (a fraction below 1 shares a GPU; above 1 must "
        "be whole); 0 = CPU actors.",
    )
    num_cpus_per_worker: PositiveInt = Field(
        1, description="CPUs reserved by each actor; also its torch thread count."
    )
    inflight_per_worker: PositiveInt = Field(
        2,
        description="Shards handed to one actor at a time, so the next is ready when one ends.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime environment of the actors (`env_vars`, `pip`, …); values "
        "under secret-looking keys are never written into the store.",
    )

    @field_validator("address")
    @classmethod
    def _address_syntax(cls, value: str | None) -> str | None:
        if value is not None and not _ADDRESS_RE.match(value):
            raise PydanticCustomError(
                "ray_address",
                "must be null, 'auto', 'ray://host:port' or 'host:port', got {value} "
                "(an http:// dashboard address is for `classgrad submit --address`)",
                {"value": repr(value)},
            )
        return value

    @field_validator("num_gpus_per_worker")
    @classmethod
    def _whole_gpus_above_one(cls, value: float) -> float:
        # Ray only allows fractional GPU requests below one GPU.
        if value > 1 and not float(value).is_integer():
            raise PydanticCustomError(
                "gpu_fraction",
                "above 1 must be a whole number, got {value}",
                {"value": value},
            )
        return value


class ProjectionConfig(_Section):
    """Optional random projection of each row to `dim` columns (Johnson–Lindenstrauss)."""

    dim: PositiveInt | None = Field(
        None, description="k, the stored row length; null = store full rows (no projection)."
    )
    kind: Literal["rademacher", "gaussian"] = Field(
        "rademacher",
        description="Distribution of the random matrix's entries: random signs or Gaussian.",
    )
    seed: NonNegativeInt = Field(
        0,
        description="Seed of the projection; the matrix is regenerated block by block from it, "
        "identically on every worker.",
    )
    per_param: bool = Field(
        False,
        description="Use a separate projection for each selected parameter instead of one over "
        "the whole row.",
    )


class RunConfig(_Section):
    """Driver behaviour that does not change the stored values."""

    lease_ttl_s: PositiveFiniteFloat = Field(
        60.0,
        description="Seconds after which another driver may take over the store's lease from "
        "a driver that stopped renewing it.",
    )
    log_every_s: PositiveFiniteFloat = Field(
        10.0, description="Seconds between progress log lines when not on a terminal."
    )
    actor_start_timeout_s: PositiveFiniteFloat = Field(
        300.0,
        description="Seconds to wait for the actors to start (a cluster without the requested "
        "CPUs/GPUs fails with a message instead of waiting forever).",
    )
    progress: Literal["auto", "bar", "log", "none"] = Field(
        "auto",
        description="`bar` (progress bar), `log` (periodic log lines), `none`, or `auto`: a bar "
        "on a terminal, log lines otherwise.",
    )


# Fields of a section that change the stored bytes; a section absent here counts whole.
# Everything else (where the store is, how the job runs) may differ between a run and its resume.
_FINGERPRINT_FIELDS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "data": None,
    "loss": None,
    "precision": None,
    "params": None,
    "engine": ("kind", "block_rows", "group_rows"),
    "sharding": ("shard_rows",),
    "store": ("dtype", "row_chunk", "col_chunk", "codec", "sharded"),
    "projection": None,
}
FINGERPRINT_VERSION = 1


class JobConfig(BaseModel):
    """A whole job file. Missing sections take their defaults (only `loss.num_classes` is
    required); cross-field checks run after every section is valid."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(description="The model.")
    data: DataConfig = Field(description="The probe set.")
    loss: LossConfig = Field(description="The per-class loss.")
    precision: PrecisionConfig = Field(description="Arithmetic precision.")
    params: ParamsConfig = Field(description="Parameter selection.")
    engine: EngineConfig = Field(description="Gradient engine.")
    sharding: ShardingConfig = Field(description="Work shards.")
    store: StoreConfig = Field(description="The Zarr store.")
    cluster: ClusterConfig = Field(description="Ray cluster and actors.")
    projection: ProjectionConfig = Field(description="Random projection.")
    run: RunConfig = Field(description="Driver behaviour.")

    @model_validator(mode="before")
    @classmethod
    def _missing_sections_are_empty(cls, data: Any) -> Any:
        # A missing section means "all defaults"; filling it with {} (rather than giving the
        # field a default) makes a missing required key report as `loss.num_classes`, not `loss`.
        # A section left empty in YAML (`store:` with every line commented out) is null: same.
        if isinstance(data, Mapping):
            data = dict(data)
            for name in cls.model_fields:
                if data.get(name) is None:
                    data[name] = {}
        return data

    @model_validator(mode="after")
    def _cross_field_checks(self) -> JobConfig:
        problems: list[str] = []
        if self.sharding.shard_rows % self.store.row_chunk:
            problems.append(
                f"sharding.shard_rows must be a multiple of store.row_chunk "
                f"({self.store.row_chunk}), got {self.sharding.shard_rows}"
            )
        if self.precision.min_scale > self.precision.init_scale:
            problems.append(
                f"precision.min_scale ({self.precision.min_scale}) must be at most "
                f"precision.init_scale ({self.precision.init_scale})"
            )
        if self.engine.kind == "partitioned" and self.loss.kind in DENSE_LOSS_KINDS:
            problems.append(
                f"engine.kind 'partitioned' needs a class-partitioned loss, but loss.kind "
                f"{self.loss.kind!r} is dense (use engine.kind 'dense' or 'auto')"
            )
        device = self.engine.device
        no_gpus = self.cluster.num_gpus_per_worker == 0
        if device is not None and device.startswith("cuda") and no_gpus:
            # Ray hides every GPU from an actor that reserves none, so this could never work.
            problems.append(
                f"engine.device {device!r} needs cluster.num_gpus_per_worker > 0 "
                f"(Ray hides GPUs from actors that reserve none)"
            )
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PydanticCustomError(
                "cross_field", "{problem}{more}", {"problem": problems[0], "more": more}
            )
        return self

    def resolved_device(self) -> str:
        """The torch device actors use: `engine.device`, or cuda/cpu from the GPU reservation."""
        if self.engine.device is not None:
            return self.engine.device
        return "cuda" if self.cluster.num_gpus_per_worker > 0 else "cpu"

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of what changes the stored bytes.

        A store is resumed only by a config with the same fingerprint, so this includes the
        model, data, loss, precision, parameter selection, engine algorithm, shard and chunk
        layout, stored dtype/codec and projection; it excludes where the store lives, its
        credentials, the cluster and the driver's behaviour.
        """
        dumped = self.model_dump(mode="json")
        selected: dict[str, Any] = {"fingerprint_version": FINGERPRINT_VERSION}
        for section, fields in _FINGERPRINT_FIELDS.items():
            values = dumped[section]
            selected[section] = values if fields is None else {f: values[f] for f in fields}
        canonical = json.dumps(selected, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def redacted(self) -> dict[str, Any]:
        """The whole config as a JSON-able dict, with secrets replaced by ``"***"``.

        Secrets are values under any key containing key/secret/token/password/credential
        (any case, any depth) in `store.storage_options` and `cluster.runtime_env` (where
        `env_vars` commonly carries cloud credentials). This is what the store's attributes hold.
        """
        dumped = self.model_dump(mode="json")
        dumped["store"]["storage_options"] = _redact(dumped["store"]["storage_options"])
        dumped["cluster"]["runtime_env"] = _redact(dumped["cluster"]["runtime_env"])
        return dumped


def _redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _REDACTED if _SECRET_RE.search(str(k)) else _redact(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


# --------------------------------------------------------------------------- loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (plain safe_load silently keeps the last one)."""


def _construct_mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    # Checked before merge keys ("<<: *base") are flattened: overriding a merged key is fine.
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # an unhashable (complex) key; construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates
)


def _yaml_problem(exc: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line or None, short description) of a YAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    text = f"{context}: {problem}" if context and "duplicate key" not in problem else problem
    return line, " ".join(str(text).split())


def _read_yaml_file(path: str | Path) -> dict[str, Any]:
    name = str(path)
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config error: {name}: not found")
    if not p.is_file():
        raise ConfigError(f"config error: {name}: not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config error: {name}: cannot read ({exc})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        line, problem = _yaml_problem(exc)
        where = f"{name} line {line}" if line is not None else name
        raise ConfigError(f"config error: {where}: malformed YAML ({problem})") from None
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config error: {name}: the top level must be a mapping of sections "
            f"({', '.join(JobConfig.model_fields)}), got {_type_word(data)}"
        )
    return data


def _type_word(value: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, merging nested mappings key by key (used for base + file)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _field_annotation_kind(annotation: Any) -> type[BaseModel] | str:
    """A section model class, "mapping" for free-form dict fields, or "leaf"."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is dict:
        return "mapping"
    return "leaf"


def _section_keys(model: type[BaseModel]) -> str:
    return ", ".join(sorted(model.model_fields))


def _check_override_path(parts: list[str], raw_key: str) -> None:
    """Refuse a --set path that names no field (free-form mappings accept any sub-key)."""
    node: type[BaseModel] | str = JobConfig
    for depth, part in enumerate(parts):
        if node == "mapping":
            return
        if node == "leaf":
            parent = ".".join(parts[:depth])
            raise ConfigError(f"config error: --set {raw_key}: {parent} is not a mapping")
        assert isinstance(node, type)
        if part not in node.model_fields:
            what = "unknown section" if node is JobConfig else "unknown key"
            raise ConfigError(
                f"config error: --set {raw_key}: {what} (choices: {_section_keys(node)})"
            )
        node = _field_annotation_kind(node.model_fields[part].annotation)


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw_value = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        raise ConfigError(f"config error: --set {override}: expected key=value")
    _check_override_path(parts, key)
    try:
        # A YAML scalar or flow value, so "3" is an int, "true" a bool, "[a, b]" a list and
        # "null" None, exactly as they would be in the file.
        value = yaml.load(raw_value, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        _, problem = _yaml_problem(exc)
        raise ConfigError(f"config error: --set {key}: malformed value ({problem})") from None
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            parent = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"config error: --set {key}: {parent} is {_type_word(child)}, not a mapping"
            )
        node = child
    node[parts[-1]] = value


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_loc(loc: Sequence[int | str]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    node: type[BaseModel] | str = JobConfig
    for part in loc:
        if not isinstance(node, type) or part not in node.model_fields:
            return None
        node = _field_annotation_kind(node.model_fields[part].annotation)
    return node if isinstance(node, type) else None


def _error_line(err: Mapping[str, Any]) -> str:
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    msg = str(err.get("msg", ""))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        what = "unknown section" if parent is JobConfig else "unknown key"
        msg = f"{what} (choices: {_section_keys(parent)})" if parent else "unknown key"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = f"expected a mapping, got {_type_word(err.get('input'))}"
    elif kind == "literal_error" or kind.endswith("_parsing"):
        msg = f"{msg}, got {_short_repr(err.get('input'))}"
    elif kind.endswith("_type"):
        msg = f"{msg}, got {_type_word(err.get('input'))}"
    where = _format_loc(loc)
    return f"{where}: {msg}" if where else msg


def _validation_message(exc: ValidationError) -> str:
    # Unknown keys first: a misspelt key usually also makes its intended key "required", and
    # the misspelling is the thing to fix.
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    line = f"config error: {_error_line(errors[0])}"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more)"
    return " ".join(line.split())  # one line, whatever a message contained


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> JobConfig:
    """Build a `JobConfig` from `base` (a mapping), then the YAML file at `path` merged over it,
    then each ``"a.b=c"`` override in order (the value parsed as YAML; an override replaces the
    value at its path, a whole mapping included).

    Raises `ConfigError` with one line naming the field (or the file, or the override) for
    every problem.
    """
    if base is not None and not isinstance(base, Mapping):
        raise ConfigError(
            f"config error: the base config must be a mapping, got {_type_word(base)}"
        )
    data: dict[str, Any] = copy.deepcopy(dict(base)) if base is not None else {}
    if path is not None:
        data = _deep_merge(data, _read_yaml_file(path))
    if isinstance(overrides, str):  # a lone "a=b" would otherwise be iterated per character
        overrides = (overrides,)
    for override in overrides:
        _apply_override(data, override)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc)) from None


# --------------------------------------------------------------------------- reference


def _describe_type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extra = typing.get_args(annotation)
        return _describe_type(inner, [*metadata, *extra])
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        text = " or ".join(_describe_type(a, metadata) for a in args)
        return f"{text} or null" if len(args) < len(typing.get_args(annotation)) else text
    if origin is dict:
        return "mapping"
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"list of {_describe_type(item)}"
    name = getattr(annotation, "__name__", str(annotation))
    bounds = []
    for meta in metadata:
        for attr, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            bound = getattr(meta, attr, None)
            if bound is not None and isinstance(meta, annotated_types.BaseMetadata):
                bounds.append(f"{symbol} {bound}")
    return f"{name} {', '.join(bounds)}" if bounds else name


def _describe_default(info: Any) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def config_reference_markdown() -> str:
    """The job file reference (one table per section) rendered from the field descriptions."""
    lines: list[str] = []
    for section, section_info in JobConfig.model_fields.items():
        model = section_info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        doc = " ".join((model.__doc__ or "").split())
        lines += [f"### `{section}`", "", doc, "", "| key | type | default | description |"]
        lines.append("| --- | --- | --- | --- |")
        for key, info in model.model_fields.items():
            type_text = _describe_type(info.annotation, info.metadata)
            description = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{key}` | {type_text} | {_describe_default(info)} | {description} |")
        lines.append("")
    return "\n".join(lines)

