"""The worker: one model replica that computes whole shards and writes them to the store.

Holds ``GradientWorker``, a plain class (no Ray import) that the driver turns into a Ray actor
with ``ray.remote``; tests and benchmarks can use it directly. It builds its model, probe set,
engine and (optional) projector once, and refuses to start when its build differs from the
driver's (the run's identity, ``identity``); then for each shard: computes the rows block by
block, hands them to a ``ShardWriter`` (writes overlap compute), marks the shard done only once every
row is stored, and returns a small report (with its process's peak memory so far,
``peak_memory``, which the driver keeps beside its preflight's estimate). Rows never travel back
to the driver. Also holds ``secrets_hidden`` and ``redacted`` (an exception's text with its
secrets hidden, before Ray logs it).

What a stored row is (the projector, the blocks gathered for projection, the store's projection
record) lives in ``stored_rows``, which the driver, ``classgrad estimate`` and the query side
share with the actor.
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
from classgrad.workers.actor_runtime.factory import build_job_engine
from classgrad.workers.actor_runtime.identity import check_same_build, engine_identity
from classgrad.workers.actor_runtime.shard_writer import ShardWriter
from classgrad.workers.actor_runtime.stored_rows import build_projector, project_rows_for, stored_blocks

log = logging.getLogger(__name__)


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
