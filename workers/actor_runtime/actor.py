"""The worker: one model replica that computes whole shards and writes them to the store.

Holds ``GradientWorker``, a plain class (no Ray import) that the driver turns into a Ray actor
with ``ray.remote``; tests and benchmarks can use it directly. It builds its model, probe set,
engine and (optional) projector once, and refuses to start when its build differs from the
driver's (the run's identity, ``identity``); then for each shard: computes the rows block by
block, hands them to a ``ShardWriter`` (writes overlap compute), marks the shard done only once every
row is stored, and returns a small report (with its process's peak memory so far,
``peak_memory``, which the driver keeps beside its preflight's estimate). Rows never travel back
to the driver.

Also holds what the driver and ``classgrad estimate`` share with it: ``build_projector``,
``checked_engine`` (engine + preflight + projector + stored row width; ``stored_width`` from the engines),
``projection_record`` (the store's ``projection`` attribute) and ``stored_blocks``
(the blocks a worker stores, projected in batches of ``project_rows_for(dim)`` rows).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from classgrad.config import JobConfig
from classgrad.config.redaction import redact_text
from classgrad.errors import LeaseHeldError
from classgrad.store import open_store
from classgrad.workers.actor_runtime.factory import build_job_engine, preflight
from classgrad.workers.actor_runtime.identity import check_same_build, engine_identity
from classgrad.workers.actor_runtime.shard_writer import ShardWriter
from classgrad.workers.engines import (
    GradientEngine,
    ProjectedEngine,
    RowBlock,
    finished_projector,
    projection_options,
    stored_width,
)
from classgrad.workers.structures import RowProjector

log = logging.getLogger(__name__)

PROJECT_BYTES = 1 << 30


def build_projector(
    config: JobConfig,
    slots=None,
    dim_in: int | None = None,
    *,
    engine: GradientEngine | None = None,
    record: dict | None = None,
) -> RowProjector | None:
    """The job's projector of ``engine``'s finished rows (dense, or a sketch), or None when rows
    are stored whole or projected inside the backward (a ``ProjectedEngine``). ``record``: the
    store's ``projection`` attribute (an unset ``projection.structure`` resumes with it). Without
    ``engine``, the finished rows of ``slots`` (``dim_in`` wide) for a structure that projects
    finished rows; None for one that projects in the backward."""
    options = projection_options(config.projection, record)
    if engine is not None:
        return finished_projector(options, engine)
    if options is None or slots is None or dim_in is None or options.spec.in_backward:
        return None
    return options.finished_projector(slots, dim_in)


def checked_engine(
    config: JobConfig,
    device: str | None = None,
    record: dict | None = None,
) -> tuple[GradientEngine, RowProjector | None, int]:
    """The job's engine, checked against its real model and data (``preflight``), its
    projector (None when rows are stored whole or projected by the engine) and the width of a
    stored row. ``record``: a store's ``projection`` attribute to resume with (see ``build_job_engine``)."""
    engine = build_job_engine(config, device=device, record=record)
    preflight(engine)
    projector = build_projector(config, engine=engine, record=record)
    return engine, projector, stored_width(engine, projector)


def projection_record(engine: GradientEngine, projector: RowProjector | None) -> dict | None:
    """What the store records about the projection (None: full rows)."""
    if isinstance(engine, ProjectedEngine):
        return engine.describe()
    return projector.describe() if projector else None


def project_rows_for(dim: int) -> int:
    """Rows gathered per projection: enough to amortise generating R, at most ~1 GiB of rows
    of ``dim`` float32 values."""
    return max(1, min(256, PROJECT_BYTES // (4 * dim)))


def stored_blocks(
    engine: GradientEngine, projector: RowProjector | None, classes: list[int], project_rows: int
) -> Iterator[tuple[RowBlock, torch.Tensor | None]]:
    """Engine blocks of ``classes`` with the rows to store: projected when the job projects.

    Generating R costs about as much as applying it to a few dozen rows (a sketch's buckets,
    when too many to keep, cost several times the sketch itself), so blocks are gathered up to
    ``project_rows`` rows before each projection (bounded by a byte budget).
    What a worker stores, and what ``classgrad estimate`` times.
    """
    if projector is None:
        for block in engine.iter_blocks(classes):
            yield block, None
        return
    pending: list[RowBlock] = []
    gathered = 0
    for block in engine.iter_blocks(classes):
        pending.append(block)
        gathered += len(block)
        if gathered >= project_rows:
            yield _projected(projector, pending)
            pending, gathered = [], 0
    if pending:
        yield _projected(projector, pending)


def _projected(projector: RowProjector, blocks: list[RowBlock]) -> tuple[RowBlock, torch.Tensor]:
    merged = RowBlock.concat(blocks)
    return merged, projector.project(merged.rows)  # project() takes any float dtype


class GradientWorker:
    """Computes shards of one job's per-class gradient matrix and writes them to its store."""

    def __init__(
        self,
        config: dict,
        *,
        num_threads: int | None = None,
        run_id: str | None = None,
        identity: dict | None = None,
        probe_targets: Any = None,
    ):
        """``identity``: the driver's build (this one must match it); ``probe_targets``: the probe
        set's targets as the driver gathered them (an array; Ray hands every actor of a node
        the one copy the driver put), so that this actor reads only the samples its shards need
        and hashes none: the probe set's digest is the driver's (``identity``)."""
        with secrets_hidden():  # Ray logs what an actor raises: never the secrets in it
            self._build(config, num_threads, run_id, identity, probe_targets)

    def _build(
        self, config: dict, num_threads: int | None, run_id: str | None, identity: dict | None, probe_targets: Any
    ) -> None:
        self.config = JobConfig.model_validate(config)
        self.run_id = run_id  # the driver's run; shards are marked done only while it holds the lease
        if num_threads:
            torch.set_num_threads(num_threads)
        store_cfg = self.config.store
        self.store = open_store(store_cfg.url, storage_options=store_cfg.storage_options, mode="r+")
        # The store's projection record: the structure an unset projection.structure runs with,
        # and the map the driver fixed (a Kronecker split measured once): every worker reuses it.
        record = self.store.attrs.get("projection") if self.config.projection.dim is not None else None
        driver_probe = None
        if probe_targets is not None and identity is not None:
            driver_probe = (torch.as_tensor(np.array(probe_targets)), str(identity["probe"]))
        self.engine = build_job_engine(self.config, record=record, driver_probe=driver_probe)
        if identity is not None:  # the driver's: this build must compute the same rows, or write none
            check_same_build(identity, engine_identity(self.engine))
        self.projector = build_projector(self.config, engine=self.engine, record=record)
        self.project_rows = project_rows_for(self.engine.layout.dim)
        self.class_ids = self.store.class_ids
        self.identity = {
            "node": _node_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(self.engine.device),
            "engine": self.engine.name,
        }
        log.info("worker ready: %s", self.identity)

    def ready(self) -> dict[str, Any]:
        return dict(self.identity)

    def compute_shard(self, shard: int, attempt: int = 1) -> dict[str, Any]:
        """Compute and store every row of ``shard``; return a small report."""
        with secrets_hidden():
            return self._compute_shard(shard, attempt)

    def _compute_shard(self, shard: int, attempt: int) -> dict[str, Any]:
        start, stop = self.store.shard_range(shard)
        self._check_lease(shard)  # an actor of a run that lost the store starts no shard in it
        t0 = time.perf_counter()
        recomputed_before = self.engine.stats.recomputed_rows
        writer = ShardWriter(self.store, start, stop)
        try:
            classes = self.class_ids[start:stop].tolist()
            for block, rows in stored_blocks(self.engine, self.projector, classes, self.project_rows):
                writer.add(block, rows)
            written = writer.close()
        except BaseException:
            writer.abort()
            raise
        self._check_lease(shard)
        self.store.mark_shard_done(shard)
        return {
            "shard": shard,
            "attempt": attempt,
            "rows": stop - start,
            "seconds": time.perf_counter() - t0,
            "write_seconds": written.seconds,
            "bytes": written.bytes,
            "recomputed_rows": self.engine.stats.recomputed_rows - recomputed_before,
            "engine_notes": list(self.engine.stats.notes),  # the path it took, and why; the driver dedupes
            **peak_memory(self.engine.device),  # the driver records it beside its estimate
            **self.identity,
        }

    def _check_lease(self, shard: int) -> None:
        """Refuse to start a shard, or mark it done, for a run that no longer holds the store.

        An actor that outlives its driver (killed with SIGKILL) or was paused past the lease's
        TTL may still finish a shard; if a new run has since replaced the store
        (``store.overwrite``), that shard must not count. What it wrote between the checks is
        never read as the new store's: its record carries the store creation it opened, and
        readers check chunks against the new creation's records (``store.verified``).
        """
        if self.run_id is None:
            return
        holder = (self.store.lease.info() or {}).get("run_id")
        if holder != self.run_id:
            raise LeaseHeldError(
                f"run {self.run_id!r} no longer holds the lease of {self.store.url} (held by {holder!r}); "
                f"shard {shard} is not computed nor marked done"
            )


@contextlib.contextmanager
def secrets_hidden() -> Iterator[None]:
    """Re-raise an exception of the block with its text redacted (``redacted``; its cause
    dropped), or as it is when there is nothing to hide."""
    try:
        yield
    except Exception as exc:
        hidden = redacted(exc)
        if hidden is exc:
            raise
        raise hidden from None


def redacted(exc: Exception) -> Exception:
    """``exc`` itself when its text holds nothing secret-looking, else the same type (or
    ``RuntimeError`` naming it) with the text redacted (``redact_text``: token shapes, secret
    values): what Ray prints into its logs and hands the driver, which redacts again."""
    text = str(exc)
    clean = redact_text(text)
    if clean == text:
        return exc
    try:
        return type(exc)(clean)
    except Exception:  # noqa: BLE001 - a type that takes other arguments
        return RuntimeError(f"{type(exc).__name__}: {clean}")


def peak_memory(device: torch.device) -> dict[str, int]:
    """This process's peak resident memory so far (``peak_rss_bytes``: the kernel's high-water
    mark on Linux, else ``ru_maxrss``) and, on a GPU, the peak memory allocated there."""
    peak = None
    try:
        with open("/proc/self/status") as fh:
            peak = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:")), None)
    except (OSError, ValueError):
        pass
    if peak is None:
        import resource
        import sys

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024  # Linux reports KiB
    out = {"peak_rss_bytes": int(peak)}
    if device.type == "cuda":
        out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:  # the worker also runs without Ray (tests, benchmarks)
        pass
    return socket.gethostname()
