"""What the driver does before any actor starts: check the job, prepare its store, trust its shards.

Holds:
- ``check_job``: builds the job's engine once on the driver (on the CPU) to check the config
  against the real model and data before anything is written, and takes the run's identity
  from that build (what the rows are computed from: ``classgrad.workers.actor_runtime.identity``);
  returns a ``CheckedJob`` (the store spec and the planned shards). ``recorded_projection``: a
  projected job's existing store's record (its structure and map), reused on a resume.
- ``prepare_store``: creates or reopens the store (same fingerprint required; a store of the same
  job under an older fingerprint scheme, ``resumable_fingerprint``) with all of its metadata,
  under the lease that ``JobDriver.run`` takes first; returns a ``PreparedJob``.
- the resource preflight, in ``check_job``: its build of the job is measured and the job's
  footprint checked against this node (``classgrad.service.driver_runtime.preflight``).
- ``check_identity``: before any done shard is trusted, the store's recorded identity must be
  this run's (a checkpoint, data or factory code changed at the same path is refused).
- ``library_versions``: what the store records of the software that wrote it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from classgrad.config import JobConfig
from classgrad.errors import ConfigMismatchError, StoreError, StoreMismatchError
from classgrad.service.driver_runtime.plan import Shard, plan_shards
from classgrad.store import GradStore, HeldLease, StoreSpec, create_store, open_store
from classgrad.store.core.format import OVERWRITE_HINT
from classgrad.workers.actor_runtime.identity import RunIdentity, engine_identity, identity_changes, listed
from classgrad.workers.actor_runtime.stored_rows import checked_engine, projection_record
from classgrad.workers.model_io import class_names_of

log = logging.getLogger(__name__)


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {}
    for name in ("classgrad", "torch", "ray", "zarr", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return versions


@dataclass
class CheckedJob:
    """The job checked against its real model and data: the store it needs and its shards."""

    spec: StoreSpec
    shards: list[Shard]
    engine_kind: str
    dim: int
    identity: dict  # RunIdentity.to_dict() of the driver's build: the actors' builds must match it
    engine_notes: list[str] = field(default_factory=list)  # the driver's build: the path it took, and why
    footprint: dict | None = None  # Footprint.to_dict(): the estimate the run history records
    preflight_notes: list[str] = field(default_factory=list)  # clamps and warnings near a limit
    # The probe set's targets as the driver gathered them: the actors take them (and the digest
    # in ``identity``) instead of reading and hashing every sample themselves.
    probe_targets: np.ndarray | None = None


@dataclass
class PreparedJob:
    store: GradStore
    shards: list[Shard]
    engine_kind: str
    dim: int
    identity: dict  # RunIdentity.to_dict() of the driver's build: the actors' builds must match it


def resumable_fingerprint(config: JobConfig) -> str:
    """The config's fingerprint, or the one recorded in its existing store when that store was made
    by the same job under an older fingerprint scheme (so it is resumed rather than refused)."""
    fingerprint = config.fingerprint()
    if config.store.recompute:  # the store is replaced anyway; the new one records today's fingerprint
        return fingerprint
    try:
        attrs = open_store(config.store.url, storage_options=config.store.storage_options).attrs
    except StoreError:  # no usable store there: create_store creates it or says what is wrong
        return fingerprint
    recorded = attrs.get("fingerprint")
    if isinstance(recorded, str) and recorded != fingerprint and config.same_job(attrs.get("config")):
        log.info("store %s: same job under an older fingerprint scheme (%s); resuming it", config.store.url, recorded)
        return recorded
    return fingerprint


def recorded_projection(config: JobConfig) -> dict | None:
    """The ``projection`` attribute of the job's existing store, when this job made it: a resume
    runs the structure it records (an unset ``projection.structure`` included: a store made under
    an earlier default keeps its map) and reuses its map rather than measuring again (a Kronecker
    split, which on another machine could round differently)."""
    if config.projection.dim is None:
        return None
    if config.store.overwrite or config.store.recompute:
        return None
    try:
        attrs = open_store(config.store.url, storage_options=config.store.storage_options).attrs
    except StoreError:
        return None
    record = attrs.get("projection")
    if not isinstance(record, dict):
        return None
    # An unset structure: the store's own fingerprint will do. A store made when unset meant
    # dense records `structure: dense` in its config, which today's schema hashes (unset is the
    # default now); its record then says what to resume with.
    unset = config.projection.structure is None and attrs.get("fingerprint") == config.fingerprint()
    same = unset or config.same_job(attrs.get("config"))
    return record if same else None


def check_job(config: JobConfig, *, preflight: bool = True) -> CheckedJob:
    """Check the job against its real model and data, and say what store it needs.

    Every user error (bad factory, wrong output width, labels out of range, patterns that
    select nothing) is raised here, before the store's lease is taken or a store exists, and
    so is a job that cannot fit this node's memory or disk (``preflight``: False skips that).
    """
    from classgrad.service.driver_runtime.footprint import BuildMeter
    from classgrad.service.driver_runtime.preflight import preflight_job

    meter = BuildMeter.started()  # what each actor's build of the same model and data will take
    engine, projector, dim = checked_engine(config, device="cpu", record=recorded_projection(config))
    built = meter.stop()
    footprint, notes = preflight_job(config, engine, projector, dim, build_bytes=built, check=preflight)
    identity = engine_identity(engine).to_dict()
    layout = engine.layout
    projection = projection_record(engine, projector)
    spec = StoreSpec(
        num_classes=config.loss.num_classes,
        dim=dim,
        shard_rows=config.sharding.shard_rows,
        row_chunk=config.store.row_chunk,
        col_chunk=min(config.store.col_chunk, dim),
        dtype=config.store.dtype,
        codec=config.store.codec,
        sharded=config.store.sharded_layout(),
        layout=() if projection is not None else layout.slots,
        loss_kind=engine.loss.name,
        class_names=class_names_of(engine.model, config.loss.num_classes),
        projection=projection,
        config=config.redacted(),
        fingerprint=resumable_fingerprint(config),
        identity=identity,
        versions=library_versions(),
    )
    # Partitioned work grows with a class's samples; dense rows all cost the same.
    work = engine.counts.double().clamp(min=1).numpy() if engine.name == "partitioned" else None
    shards = plan_shards(spec.num_classes, spec.shard_rows, spec.row_chunk, work_per_row=work)
    return CheckedJob(
        spec=spec,
        shards=shards,
        engine_kind=engine.name,
        dim=dim,
        identity=identity,
        engine_notes=list(engine.stats.notes),
        footprint=footprint.to_dict(),
        preflight_notes=notes,
        probe_targets=engine.probe.targets.numpy(),
    )


def prepare_store(
    config: JobConfig, *, lease: HeldLease | None = None, checked: CheckedJob | None = None
) -> PreparedJob:
    """Check the job (``check_job``, unless ``checked`` is given), then create (or reopen) its store
    under ``lease``, the caller's lease on it (without one, a lease is held for the creation alone).

    A store made by another config is refused here, before anything is written, naming the keys
    that differ.
    """
    job = checked or check_job(config)
    try:
        store = create_store(
            config.store.url,
            job.spec,
            storage_options=config.store.storage_options,
            overwrite=config.store.overwrite,
            recompute=config.store.recompute,
            lease=lease,
        )
    except ConfigMismatchError as exc:
        raise _naming_the_keys(exc, config) from None
    return PreparedJob(store=store, shards=job.shards, engine_kind=job.engine_kind, dim=job.dim, identity=job.identity)


def _naming_the_keys(exc: ConfigMismatchError, config: JobConfig) -> ConfigMismatchError:
    """``exc`` with the keys on which this config and the store's recorded one differ (the first
    few; values are not shown, since the recorded config has its secrets hidden)."""
    try:
        recorded = open_store(config.store.url, storage_options=config.store.storage_options).attrs.get("config")
    except StoreError:
        return exc
    keys = config.differing_keys(recorded)
    if not keys:
        return exc
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return ConfigMismatchError(
        f"store at {config.store.url} was made by another config: {shown} differ; use another store.url, "
        f"or replace it with {OVERWRITE_HINT}"
    )


def check_identity(store: GradStore, identity: dict) -> None:
    """Refuse (``StoreMismatchError``, one line saying what changed) a store whose done shards were
    computed from other inputs than ``identity`` (this run's). A store with no shard done takes
    this run's identity; one made before identities were recorded is resumed as before."""

    recorded = store.spec.identity
    current = RunIdentity.from_dict(identity)
    if recorded is None or current is None:
        log.info("store %s records no identity of its inputs (made before they were recorded)", store.url)
        return
    changed = identity_changes(recorded, current)
    if not changed:
        return
    done = int(store.shard_done.sum())
    if not done:
        log.warning("store %s: no shard is done yet; it now records this run's inputs (%s)", store.url, listed(changed))
        store.record_identity(identity)
        return
    raise StoreMismatchError(
        f"store at {store.url} holds {done} done shards computed from other inputs: {listed(changed)} differ from "
        f"this run's (model.checkpoint, data or factory code changed at the same path?); restore the inputs it was "
        f"made with, or use another store.url, or replace it with {OVERWRITE_HINT}"
    )
