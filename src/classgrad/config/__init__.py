"""The typed job config: what one ``classgrad run`` computes, where it stores it, how it runs.

Holds only re-exports; the parts live in:

- ``fields``: the section base, bounded number types, import-path/device/address syntax;
- ``inputs`` (model, data, loss), ``compute`` (precision, params, engine), ``projection`` (the
  keys every structure shares, and the table of each structure's options model) and
  ``placement`` (sharding, store, cluster, run): one pydantic model per section, with the
  defaults (here and nowhere else) and a description per field;
- ``job``: ``JobConfig``, which holds every section and does the cross-field checks;
- ``fingerprint``: what makes two stores interchangeable, and today's fingerprint of a config
  recorded in an older store; ``redaction``: secrets hidden from the config written into a store;
- ``loading``: ``load_config``, YAML file + ``--set a.b=c`` overrides -> ``JobConfig``, every
  problem a ``ConfigError`` with one line that names the field;
- ``reference``: the README's config reference, generated from the field descriptions.

Nothing here imports torch, Ray or ``classgrad.workers``: a config is checked (syntax of import
paths included) before anything heavy is loaded, and the CLI can reject a bad file instantly.
"""

from __future__ import annotations

from classgrad.config.compute import EngineConfig, ParamsConfig, PrecisionConfig
from classgrad.config.fields import canonical_import_path
from classgrad.config.fingerprint import FINGERPRINT_VERSION, recorded_fingerprint
from classgrad.config.inputs import (
    BUILTIN_LOSS_KINDS,
    CHECKPOINT_SUFFIXES,
    DENSE_LOSS_KINDS,
    DataConfig,
    LossConfig,
    ModelConfig,
)
from classgrad.config.job import JobConfig
from classgrad.config.loading import load_config, section_at
from classgrad.config.placement import ClusterConfig, RunConfig, ShardingConfig, StoreConfig
from classgrad.config.projection import ProjectionConfig
from classgrad.config.reference import config_reference_markdown

__all__ = [
    "BUILTIN_LOSS_KINDS",
    "CHECKPOINT_SUFFIXES",
    "DENSE_LOSS_KINDS",
    "FINGERPRINT_VERSION",
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
    "canonical_import_path",
    "config_reference_markdown",
    "load_config",
    "recorded_fingerprint",
    "section_at",
]
