"""The sections that say where the job runs and stores its rows: sharding, store, cluster, run.

Holds ``ShardingConfig``, ``StoreConfig``, ``ClusterConfig`` and ``RunConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator
from pydantic_core import PydanticCustomError

from classgrad.service.config.fields import ADDRESS_RE, NonNegativeFiniteFloat, PositiveFiniteFloat, Section

__all__ = ["ClusterConfig", "RunConfig", "ShardingConfig", "StoreConfig"]


class ShardingConfig(Section):
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


class StoreConfig(Section):
    """The Zarr store the rows are written to (see DESIGN.md, "Store format")."""

    url: str = Field(
        "./stores/demo.zarr",
        min_length=1,
        description="Where the store lives: a path, `file://…`, `s3://bucket/path` or `memory://…`.",
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Stored row dtype; float16/bfloat16 rows are stored with a per-row scale "
        "(bfloat16 as its uint16 bits).",
    )
    row_chunk: PositiveInt = Field(16, description="Rows per chunk of `grads`.")
    col_chunk: PositiveInt = Field(1048576, description="Columns per chunk of `grads` (capped at the row length).")
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
        "(a store with the same fingerprint is resumed either way; see `recompute`), and finish "
        "the deletion of a store that an interrupted overwrite left, or delete a store's "
        "leftover chunks. Only keys a classgrad store holds are deleted, never other files.",
    )
    recompute: bool = Field(
        False,
        description="Delete an existing store with this config's fingerprint and compute every "
        "row again, instead of resuming it (a store of another config still needs `overwrite`).",
    )


class ClusterConfig(Section):
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
    num_cpus_per_worker: PositiveInt = Field(1, description="CPUs reserved by each actor; also its torch thread count.")
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
        if value is not None and not ADDRESS_RE.match(value):
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


class RunConfig(Section):
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
