"""The whole job file: ``JobConfig``, its cross-field checks, fingerprint and redacted form.

Holds ``JobConfig``: every section (missing ones take their defaults), the checks that need more
than one section, ``resolved_device``, ``fingerprint``/``same_job`` (see ``fingerprint``) and
``redacted`` (the config as written into the store, secrets hidden).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator
from pydantic_core import PydanticCustomError

from classgrad.config.choices import DENSE_LOSS_KINDS, IN_BACKWARD_STRUCTURES, PARTITIONED_ENGINES
from classgrad.config.compute import EngineConfig, ParamsConfig, PrecisionConfig, scales_in_order
from classgrad.config.fingerprint import FINGERPRINT_FIELDS, differing_keys, fingerprint, recorded_fingerprint
from classgrad.config.inputs import DataConfig, LossConfig, ModelConfig
from classgrad.config.placement import ClusterConfig, RunConfig, ShardingConfig, StoreConfig
from classgrad.config.projection import ProjectionConfig
from classgrad.config.redaction import redact

__all__ = ["JobConfig"]


def _import_plugins(section: Any) -> None:
    """Import ``engine.plugins`` (before the sections that may name what they register are
    checked); a module that cannot be imported is one line naming it."""
    modules = section.get("plugins", []) if isinstance(section, Mapping) else []
    for i, name in enumerate(modules if isinstance(modules, list) else []):
        if not isinstance(name, str):
            continue  # the section's own check reports it
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the user's module: any failure is theirs, said in one line
            raise PydanticCustomError(
                "plugin_import",
                "engine.plugins[{i}]: cannot import {name} ({error})",
                {"i": i, "name": repr(name), "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]},
            ) from None


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
    # Its structure's options model (a subclass): dumped as that, with its own keys.
    projection: SerializeAsAny[ProjectionConfig] = Field(description="Random projection.")
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
            _import_plugins(data["engine"])
        return data

    @model_validator(mode="after")
    def _cross_field_checks(self) -> JobConfig:
        problems: list[str] = []
        if self.sharding.shard_rows % self.store.row_chunk:
            problems.append(
                f"sharding.shard_rows must be a multiple of store.row_chunk "
                f"({self.store.row_chunk}), got {self.sharding.shard_rows}"
            )
        if not scales_in_order(self.precision.init_scale, self.precision.min_scale):
            problems.append(
                f"precision.min_scale ({self.precision.min_scale}) must be at most "
                f"precision.init_scale ({self.precision.init_scale})"
            )
        if self.engine.kind in PARTITIONED_ENGINES and self.loss.kind in DENSE_LOSS_KINDS:
            problems.append(
                f"engine.kind {self.engine.kind!r} needs a class-partitioned loss, but loss.kind "
                f"{self.loss.kind!r} is dense (use engine.kind 'dense' or 'auto')"
            )
        in_backward = self.projection.structure in IN_BACKWARD_STRUCTURES
        if in_backward and self.projection.dim is not None:
            fixed = self.engine.kind not in PARTITIONED_ENGINES and self.engine.kind != "auto"
            if self.loss.kind in DENSE_LOSS_KINDS or fixed:
                problems.append(
                    f"projection.structure {self.projection.structure!r} projects inside the partitioned "
                    f"engine's hook path; "
                    f"loss.kind {self.loss.kind!r} / engine.kind {self.engine.kind!r} never take it "
                    f"(use projection.structure 'dense')"
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
            raise PydanticCustomError("cross_field", "{problem}{more}", {"problem": problems[0], "more": more})
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
        credentials, the cluster and the driver's behaviour. Keys left at their defaults are not
        hashed and import paths are hashed in their canonical spelling (see ``fingerprint``).
        """
        return fingerprint({name: getattr(self, name) for name in FINGERPRINT_FIELDS})

    def differing_keys(self, recorded: Mapping[str, Any] | None) -> list[str] | None:
        """The hashed keys (``model.kwargs.seed``) on which this config and one recorded in a store
        differ; None when the recorded one cannot be read under today's schema."""
        return differing_keys({name: getattr(self, name) for name in FINGERPRINT_FIELDS}, recorded)

    def same_job(self, recorded: Mapping[str, Any] | None) -> bool:
        """Whether a config recorded in a store (``attrs["config"]``, possibly written by an
        older classgrad under an older fingerprint scheme) computes what this config computes."""
        return recorded_fingerprint(recorded) == self.fingerprint()

    def redacted(self) -> dict[str, Any]:
        """The whole config as a JSON-able dict, with secrets replaced by ``"***"``: values under
        secret-looking keys and every ``env_vars`` value, in every section at any depth, and
        credentials inside strings (URL passwords, connection strings); see ``redaction``. This is
        what the store's attributes hold and what is ever logged; the fingerprint is computed from
        the real values.
        """
        return redact(self.model_dump(mode="json"))
