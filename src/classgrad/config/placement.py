"""The sections that say where the job runs and stores its rows: sharding, store, cluster, run.

Holds ``ShardingConfig``, ``StoreConfig``, ``ClusterConfig`` and ``RunConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from classgrad.config.fields import (
    ADDRESS_RE,
    NonNegativeFiniteFloat,
    PositiveFiniteFloat,
    Section,
    StrictPositiveInt,
)

__all__ = ["ENV_VAR_MAX_BYTES", "STORE_SCHEMES", "ClusterConfig", "RunConfig", "ShardingConfig", "StoreConfig"]

# URL schemes a store may have (a plain path is a local one); memory:// is for one process only.
STORE_SCHEMES: tuple[str, ...] = ("file", "s3", "memory")
# The largest value of one `cluster.runtime_env.env_vars` entry: environment variables carry
# settings and credentials, not data (Linux refuses a single one over 128 KiB at exec).
ENV_VAR_MAX_BYTES = 64 * 1024


class ShardingConfig(Section):
    """How the classes are cut into work units handed to actors."""

    shard_rows: StrictPositiveInt = Field(
        256,
        description="Classes (rows) per shard; a multiple of `store.row_chunk` so that no two "
        "actors ever write the same chunk. The last shard may be shorter.",
    )
    max_attempts: StrictPositiveInt = Field(
        3,
        description="Attempts per shard (first try included) before the job fails naming the "
        "shard; completed shards are kept.",
    )


class StoreConfig(Section):
    """The Zarr store the rows are written to (see DESIGN.md, "Store format")."""

    url: str = Field(
        "./stores/demo.zarr",
        min_length=1,
        description="Where the store lives: a path, `file://…` or `s3://bucket/path` (`memory://…` "
        "only for tests in one process: never for a job, whose actors run in other processes).",
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Stored row dtype; float16/bfloat16 rows are stored with a per-row scale "
        "(bfloat16 as its uint16 bits).",
    )
    row_chunk: StrictPositiveInt = Field(16, description="Rows per chunk of `grads`.")
    col_chunk: StrictPositiveInt = Field(
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
        "block (fewer, larger objects on object storage: a 256-row shard is 6 PUTs on S3, against "
        "a PUT per chunk of each array unsharded; `tests/integration/test_s3_requests.py`). Left "
        "unset, a new store on `s3://` is sharded and any other is not; a store keeps the layout "
        "it was made with.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for the store's filesystem (e.g. `endpoint_url`, "
        "`client_kwargs`); values under secret-looking keys and passwords inside URLs are never "
        "written into the store or logged.",
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

    def sharded_layout(self) -> bool:
        """Whether a new store is sharded: ``sharded`` as set, or, left unset, on object storage
        (each request there costs, and sharding makes a shard a few PUTs). The default stays
        ``false`` in the config, so that the job's fingerprint, and resuming, do not change."""
        if "sharded" in self.model_fields_set:
            return self.sharded
        return self.url.lower().startswith("s3://")

    @field_validator("url")
    @classmethod
    def _supported_scheme(cls, value: str) -> str:
        scheme, sep, _ = value.partition("://")
        if sep and scheme.lower() not in STORE_SCHEMES:
            raise PydanticCustomError(
                "store_scheme",
                "unsupported scheme {scheme}:// (supported: a path, {schemes})",
                {"scheme": scheme, "schemes": ", ".join(f"{s}://" for s in STORE_SCHEMES)},
            )
        return value


class ClusterConfig(Section):
    """Where the actors run and what each one reserves."""

    address: str | None = Field(
        None,
        description="null = start a local Ray (`ray.init()`), or join the cluster named by "
        "`RAY_ADDRESS` when that is set (as inside a Ray job); `auto`, `ray://host:port` or the "
        "GCS `host:port` joins a running cluster.",
    )
    num_workers: StrictPositiveInt = Field(2, description="Number of actors (model replicas).")
    min_workers: StrictPositiveInt = Field(
        1,
        description="Actors that must be ready before the job starts computing, within "
        "`run.actor_start_timeout_s` (capped at `num_workers` and at the shards left: a job file "
        "that asks for 2 runs with `--set cluster.num_workers=1`); the others join as they "
        "start, so a slow node neither holds up nor fails the job.",
    )
    num_gpus_per_worker: NonNegativeFiniteFloat = Field(
        0.0,
        description="GPUs reserved by each actor (a fraction below 1 shares a GPU; above 1 must "
        "be whole); 0 = CPU actors.",
    )
    num_cpus_per_worker: StrictPositiveInt = Field(
        1, description="CPUs reserved by each actor; also its torch thread count."
    )
    inflight_per_worker: StrictPositiveInt = Field(
        2,
        description="Shards handed to one actor at a time, so the next is ready when one ends.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime environment of the actors (`env_vars`, `pip`, …); each "
        "`env_vars` value is a string of at most 64 KiB. Every `env_vars` value and values under "
        "secret-looking keys are never written into the store or logged.",
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

    @field_validator("runtime_env")
    @classmethod
    def _env_vars_are_small_strings(cls, value: dict[str, Any]) -> dict[str, Any]:
        env_vars = value.get("env_vars")
        if env_vars is None:
            return value
        if not isinstance(env_vars, dict):
            raise PydanticCustomError("env_vars", "env_vars must be a mapping of names to strings", {})
        for name, text in env_vars.items():
            if not isinstance(text, str):
                raise PydanticCustomError(
                    "env_vars",
                    "env_vars.{name} must be a string, got {kind}",
                    {"name": name, "kind": type(text).__name__},
                )
            size = len(text.encode("utf-8"))
            if size > ENV_VAR_MAX_BYTES:
                raise PydanticCustomError(
                    "env_vars",
                    "env_vars.{name} is {size} bytes, more than the {limit} bytes an environment variable "
                    "may hold here (pass data as a file, not through the environment)",
                    {"name": name, "size": size, "limit": ENV_VAR_MAX_BYTES},
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


# A lease must outlive several renewals (every third of it) plus a slow write of one: below
# this, another driver could take over a live, renewing run (1e-9 s let it do so at once).
MIN_LEASE_TTL_S = 5.0


def checked_lease_ttl(value: float) -> float:
    """``value`` (a lease's TTL in seconds), refused below ``MIN_LEASE_TTL_S``."""
    if value < MIN_LEASE_TTL_S:
        raise PydanticCustomError(
            "lease_ttl",
            "must be at least {low} s (the lease is renewed every third of it; a shorter one lets another "
            "driver take over a live run), got {value}",
            {"low": f"{MIN_LEASE_TTL_S:g}", "value": f"{value:g}"},
        )
    return value


class RunConfig(Section):
    """Driver behaviour that does not change the stored values."""

    lease_ttl_s: PositiveFiniteFloat = Field(
        60.0,
        description="Seconds after which another driver may take over the store's lease from "
        f"a driver that stopped renewing it (renewed every third of it); at least {MIN_LEASE_TTL_S:g}.",
    )
    log_every_s: PositiveFiniteFloat = Field(
        10.0, description="Seconds between progress log lines when not on a terminal."
    )

    @field_validator("lease_ttl_s")
    @classmethod
    def _lease_outlives_renewals(cls, value: float) -> float:
        return checked_lease_ttl(value)

    actor_start_timeout_s: PositiveFiniteFloat = Field(
        300.0,
        description="Seconds to wait for `cluster.min_workers` actors to start (a cluster without "
        "the requested CPUs/GPUs fails with a message instead of waiting forever), and the longest "
        "a job with work left waits with no actor ready (all lost, their replacements not "
        "starting) before it stops in one line, keeping every shard done so far.",
    )
    progress: Literal["auto", "bar", "log", "none"] = Field(
        "auto",
        description="`bar` (progress bar), `log` (periodic log lines), `none`, or `auto`: a bar "
        "on a terminal, log lines otherwise.",
    )
