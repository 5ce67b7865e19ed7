"""Class similarity at scale: the C x C cosine or Gram (dot) matrix of a store's rows, computed
out of core and written back into the store, with a top-k neighbour table per class; or, when
the matrix would be too large (or when asked), the top-k table alone (``similarity_topk``).

Holds ``SimilarityConfig`` (the options; defaults live here), ``DENSE_AUTO_BYTES`` and
``DENSE_MAX_BYTES`` (the sizes of the C x C float32 matrix up to which it is computed by
default, and at all), ``wants_dense`` (the choice), ``SimilarityPlan`` (row blocks, column
bands, chunk rows, and the memory bound of one task), ``plan_similarity``, ``strip_task`` (the
unit of work of a dense run: one row block's strip of the matrix and its top-k),
``top_k_rows`` and ``compute_similarity`` (the driver: refuses incomplete stores, takes the
store's lease, replaces the previous result, runs the tasks of either kind on Ray or in this
process, marks the result ready). ``PeakMemory`` is re-exported from ``memory``.

Dense or top-k only. By default the matrix is computed when it takes at most
``DENSE_AUTO_BYTES`` (1 GiB, about 16,000 classes) and the top-k table alone otherwise
(``dense=True`` / ``--dense`` and ``dense=False`` / ``--top-k-only`` choose); a dense matrix
above ``DENSE_MAX_BYTES`` (16 GiB, about 65,000 classes) is refused with one line: nobody reads
a matrix that size whole, the table holds the neighbours and ``store.similarity`` rows can be
computed for the few classes one looks at. The rest of this docstring is the dense path.

How it works. The rows are split into row blocks of ``block_rows`` rows (whole row chunks).
Task i owns the output strip S[i-block, :] (block_rows x C). For each column band (all columns
unless a block of full rows would exceed the budget) it reads its own block i, then every block
j in turn, straight from the store, and adds X_i X_j^T to the strip; block j is dropped before
block j+1 is read. So a task holds at most two row blocks (one column band each), one
block_rows x block_rows product and its strip, whatever C and D are: nothing ever holds the
whole matrix of rows, and only small reports travel through Ray. For cosine, the squared norms
of all rows are summed along the way (each task sees every row) and the strip is scaled by
1 / (|x_a| |x_b|) at the end; rows of norm 0 (classes without samples) get similarity 0. The
task then picks each row's top-k (self excluded, ties to the lower index) and writes its strip
and top-k rows into the store itself: its rows are whole chunks of the similarity array, so no
two tasks touch a chunk. Every strip is computed independently, which costs twice the
multiply-adds of a symmetric scheme but needs no intermediate storage and gives each task the
full rows that top-k needs; tiles below the diagonal are computed as the transpose of the very
product the other task computes (X_j X_i^T), so the matrix comes out exactly symmetric.

Products are float32 (BLAS sgemm, float32 accumulation; squared norms are summed in float64);
``precision="float64"`` computes in float64 at twice the memory and time. Low-precision
stores are read as true float32 values (the reader applies row_scale); projected stores work
the same (their rows are just shorter).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from classgrad.config.fields import MemoryMiB
from classgrad.config.placement import checked_lease_ttl
from classgrad.errors import ConfigError, StoreError, StoreIncompleteError
from classgrad.service.analysis import DEFAULT_BLOCK_MB, MIB, ceil_div, plan_blocks, spans, validated
from classgrad.service.analysis.memory import PeakMemory
from classgrad.service.analysis.similarity_runs import run_local, run_ray
from classgrad.service.analysis.similarity_topk import PartMerger, topk_task
from classgrad.service.analysis.topk_plan import TopKPlan, plan_topk
from classgrad.service.driver_runtime.ray_session import ray_session
from classgrad.service.driver_runtime.run_ids import new_run_id
from classgrad.store import fmt_ranges, open_store
from classgrad.units import fmt_bytes
from classgrad.workers.projection import neighbour_caveat

log = logging.getLogger(__name__)

# Rows handled at once when normalising a strip and picking top-k (bounds their scratch memory).
_WORK_ROWS = 64
# A similarity chunk (chunk_rows x C float32) stays below this many bytes.
_CHUNK_BYTES = 8 * MIB
# Room for the interpreter's own small allocations and zarr's chunk buffers in the bound.
_SLACK_BYTES = 16 * MIB
# The C x C float32 matrix is computed by default up to this size (about 16,000 classes)...
DENSE_AUTO_BYTES = 1 << 30
# ... and at all up to this one (about 65,000 classes); beyond it, the top-k table only.
DENSE_MAX_BYTES = 16 << 30


class SimilarityConfig(BaseModel):
    """Options of ``classgrad similarity`` (defaults in one place)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN options: refused in one line

    metric: Literal["cosine", "dot"] = Field(
        "cosine", description="cosine similarity of rows, or their dot product (the Gram matrix)"
    )
    top_k: int = Field(
        10,
        ge=0,
        description="neighbours kept per class (self excluded); clamped to C - 1; 0 stores no table (dense only)",
    )
    dense: bool | None = Field(
        None,
        description="True: the C x C matrix and the top-k table (refused above 16 GiB); False: the top-k "
        "table only, never C x C; None: dense when the C x C float32 matrix is at most 1 GiB",
    )
    block_rows: int | None = Field(
        None,
        ge=1,
        description="rows per task (a multiple of the store's row_chunk); default: dense, "
        "the most that keep a strip within block_mb; top-k only, the most that keep "
        "the query block within half of task_mb; both with at least tasks_per_cpu tasks per CPU",
    )
    task_mb: MemoryMiB = Field(
        512.0,
        description="memory budget in MiB of one top-k-only task (query block, stream block, "
        "scores, running top-k), from which its block sizes are chosen",
    )
    band_cols: int | None = Field(
        None, ge=1, description="columns read at once; default: all, unless a block of full rows would exceed block_mb"
    )
    block_mb: MemoryMiB = Field(
        DEFAULT_BLOCK_MB,
        description="memory budget in MiB for one block of rows as read and for one output strip (automatic sizes)",
    )
    precision: Literal["float32", "float64"] = Field(
        "float32", description="arithmetic of the products (float64: twice the memory and time)"
    )
    executor: Literal["ray", "local"] = Field(
        "ray", description="run the tasks on Ray, or one after another in this process"
    )
    address: str | None = Field(
        None,
        description="Ray address to join (default: the Ray already "
        "initialised in this process, else RAY_ADDRESS when set, else a "
        "new local one)",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per Ray task")
    tasks_per_cpu: int = Field(
        2,
        ge=1,
        description="at least this many tasks per CPU, for load balance (dense: automatic block_rows; "
        "top-k only: query blocks x candidate parts)",
    )
    lease_ttl_s: float = Field(
        120.0,
        gt=0,
        description="the store's lease is held while the "
        "run lasts: renewed every lease_ttl_s / 4 (at most 10 s) while "
        "Ray tasks run, between tasks in-process; another driver may "
        "take it over once it is this old; at least 5",
    )

    @field_validator("lease_ttl_s")
    @classmethod
    def _lease_outlives_renewals(cls, value: float) -> float:
        return checked_lease_ttl(value)


@dataclass(frozen=True)
class SimilarityPlan:
    """What every task needs to know; plain data, so it travels to Ray tasks as a dict."""

    num_classes: int
    dim: int
    block_rows: int
    band_cols: int
    chunk_rows: int
    metric: str
    top_k: int
    precision: str

    def blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.block_rows)

    def bands(self) -> list[tuple[int, int]]:
        return spans(0, self.dim, self.band_cols)

    def memory_bound(self) -> dict[str, int]:
        """Bytes one task may hold at its peak, by part, and their ``total``: two row blocks (one
        column band each; float64 copies when asked), one more block's worth for a read in
        flight (decoding, the fill check, zarr's chunk buffers), one block x block product, the
        output strip (plus its float32 copy in float64 mode), the squared norms, zarr's buffers
        for one write call, the scratch of normalising and top-k (``_WORK_ROWS`` rows at a
        time) and a fixed slack."""
        B, W, C = self.block_rows, self.band_cols, self.num_classes
        item = 8 if self.precision == "float64" else 4
        piece = B * W * 4
        parts = {
            "two_blocks": 2 * B * W * item,
            "read_in_flight": piece,
            "product": B * B * item,
            "strip": B * C * item + (B * C * 4 if item == 8 else 0),
            "norms": 2 * C * 8,
            # zarr encodes the chunks of one write call (<= 8 MiB) at once, in about 3 copies.
            "write_in_flight": 3 * max(self.chunk_rows * C * 4, 8 * MIB),
            "scratch": min(_WORK_ROWS, B) * C * (8 + 8 + 4 + 8 + 1),
            "slack": _SLACK_BYTES,
        }
        parts["total"] = sum(parts.values())
        return parts


def _chunk_rows(row_chunk: int, num_classes: int) -> int:
    """Largest divisor of row_chunk whose chunk (rows x C float32) stays below _CHUNK_BYTES."""
    best = 1
    for d in range(1, row_chunk + 1):
        if row_chunk % d == 0 and d * num_classes * 4 <= _CHUNK_BYTES:
            best = d
    return best


def plan_similarity(store, config: SimilarityConfig, workers: int = 1) -> SimilarityPlan:
    """Block rows, column bands and chunk rows for ``store`` with ``workers`` parallel tasks."""
    C, rc = store.num_classes, store.row_chunk
    if config.block_rows is None:
        strip_rows = int(config.block_mb * MIB) // (4 * C)
        parallel = ceil_div(C, config.tasks_per_cpu * workers) if workers > 1 else C
        rows = max(rc, min(strip_rows, parallel) // rc * rc)
    else:
        rows = config.block_rows
    blocks = plan_blocks(store, block_rows=rows, band_cols=config.band_cols, block_mb=config.block_mb)
    return SimilarityPlan(
        num_classes=C,
        dim=store.dim,
        block_rows=blocks.block_rows,
        band_cols=blocks.band_cols,
        chunk_rows=_chunk_rows(rc, C),
        metric=config.metric,
        top_k=min(config.top_k, C - 1),
        precision=config.precision,
    )


# --------------------------------------------------------------------------- one task


def _load(store, a: int, b: int, cols: tuple[int, int], dtype: type) -> np.ndarray:
    x = store.block(a, b, cols)
    return x if dtype is np.float32 else x.astype(np.float64)


def _add_squares(sq: np.ndarray, start: int, x: np.ndarray) -> None:
    """sq[start + r] += |x[r]|^2, pairwise-summed in float64, a few rows at a time."""
    for r in range(0, x.shape[0], 16):
        r1 = min(r + 16, x.shape[0])
        sq[start + r : start + r1] += np.square(x[r:r1]).sum(axis=1, dtype=np.float64)


def compute_strip(store, plan: SimilarityPlan, start: int, stop: int) -> tuple[np.ndarray, int]:
    """Rows [start, stop) of the similarity matrix (float32 [stop - start, C]) and the bytes
    of (true float32) values read, holding at most two row blocks (one band each), one
    product and the strip."""
    C = plan.num_classes
    dtype = np.float64 if plan.precision == "float64" else np.float32
    strip = np.zeros((stop - start, C), dtype=dtype)
    sq = np.zeros(C, dtype=np.float64) if plan.metric == "cosine" else None
    read = 0
    for band in plan.bands():
        xi = _load(store, start, stop, band, dtype)
        read += xi.shape[0] * (band[1] - band[0]) * 4
        if sq is not None:
            _add_squares(sq, start, xi)
        for j0, j1 in plan.blocks():
            if j0 == start:
                xj = xi
            else:
                xj = _load(store, j0, j1, band, dtype)
                read += xj.shape[0] * (band[1] - band[0]) * 4
                if sq is not None:
                    _add_squares(sq, j0, xj)
            # Below the diagonal, the transpose of the product the owner of block j computes,
            # so S[a, b] and S[b, a] are the same bits.
            product = (xj @ xi.T).T if j0 < start else xi @ xj.T
            strip[:, j0:j1] += product
            del xj, product
        del xi
    if sq is not None:
        norms = np.sqrt(sq)
        inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
        for r in range(0, strip.shape[0], _WORK_ROWS):
            r1 = min(r + _WORK_ROWS, strip.shape[0])
            # One float64 factor per entry, inv_a * inv_b (commutes exactly): symmetric result.
            strip[r:r1] *= inv[start + r : start + r1, None] * inv[None, :]
    if dtype is np.float64:
        strip = strip.astype(np.float32)
    return strip, read


def top_k_rows(
    strip: np.ndarray, row0: int, k: int, excluded: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest entries, excluding its own column (row0 + r) and the columns where
    ``excluded`` (bool ``[C]``) is set: (indices int64 [n, k], values float32 [n, k]), largest
    first, equal values by lower index. An excluded row itself has no neighbours; places left
    without a column: index -1, value NaN."""
    n, C = strip.shape
    index = np.empty((n, k), dtype=np.int64)
    value = np.empty((n, k), dtype=np.float32)
    if k == 0:
        return index, value
    for r in range(0, n, _WORK_ROWS):
        s = strip[r : r + _WORK_ROWS].astype(np.float32, copy=True)
        m = s.shape[0]
        local = np.arange(m)
        s[local, row0 + r + local] = -np.inf
        mute = np.zeros(m, dtype=bool)
        if excluded is not None:
            s[:, excluded] = -np.inf
            mute = excluded[row0 + r : row0 + r + m]
            s[mute] = -np.inf
        if k < C:
            part = np.argpartition(s, C - k, axis=1)[:, C - k :]
        else:
            part = np.broadcast_to(np.arange(C), (m, C)).copy()
        vals = np.take_along_axis(s, part, axis=1)
        # argpartition breaks ties at the k-th value arbitrarily: redo those rows stably.
        kth = vals.min(axis=1)
        straddle = (s == kth[:, None]).sum(axis=1) > (vals == kth[:, None]).sum(axis=1)
        straddle &= ~mute  # an excluded row names nobody: no ties worth sorting
        for i in np.flatnonzero(straddle):
            part[i] = np.argsort(-s[i], kind="stable")[:k]
            vals[i] = s[i, part[i]]
        order = np.lexsort((part, -vals), axis=-1)
        index[r : r + m] = np.take_along_axis(part, order, axis=1)
        value[r : r + m] = np.take_along_axis(vals, order, axis=1)
    if excluded is not None:  # without them, a row may have fewer than k columns to name
        none = np.isneginf(value)
        index[none], value[none] = -1, np.nan
    return index, value


def strip_task(url: str, storage_options: dict | None, plan: dict, start: int, stop: int, run_id: str) -> dict:
    """One task: compute rows [start, stop) of the matrix and their top-k from the store, write
    them into the store, and return a small report (rows, seconds, bytes read, memory)."""

    meter = PeakMemory()
    t0 = time.perf_counter()
    try:
        p = SimilarityPlan(**plan)
        store = open_store(url, storage_options=storage_options, mode="r+")
        strip, read = compute_strip(store, p, start, stop)
        index, value = top_k_rows(strip, start, p.top_k)
        store.similarity_arrays.write_rows(start, strip, run_id=run_id, topk_index=index, topk_value=value)
        del strip, index, value
    finally:
        peak = meter.close()
    return {
        "start": start,
        "stop": stop,
        "seconds": time.perf_counter() - t0,
        "read_bytes": read,
        "rss_start": meter.start,
        "rss_peak": peak,
        "rss_added": peak - meter.start,
        "exact_peak": meter.exact,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }


# --------------------------------------------------------------------------- driver


def wants_dense(config: SimilarityConfig, num_classes: int) -> bool:
    """Dense (the C x C matrix and the table) or top-k only, for ``num_classes`` rows: as asked,
    else dense up to ``DENSE_AUTO_BYTES``; refuses a dense matrix above ``DENSE_MAX_BYTES`` and
    a top-k-only run without neighbours, each with one line."""
    size = num_classes * num_classes * 4
    dense = size <= DENSE_AUTO_BYTES if config.dense is None else config.dense
    if dense and size > DENSE_MAX_BYTES:
        raise ConfigError(
            f"similarity option dense (--dense): the {num_classes:,} x {num_classes:,} float32 matrix would "
            f"take {fmt_bytes(size)}, above the limit of {fmt_bytes(DENSE_MAX_BYTES)}; drop --dense to "
            f"store the top-k neighbour table only"
        )
    if not dense and config.top_k == 0:
        why = "--top-k-only" if config.dense is False else f"the matrix would take {fmt_bytes(size)}"
        raise ConfigError(
            f"similarity option top_k (--top-k): 0 stores nothing without the matrix ({why}); "
            f"give --top-k K >= 1, or --dense"
        )
    return dense


def _plan(store, config: SimilarityConfig, dense: bool, workers: int = 1) -> SimilarityPlan | TopKPlan:
    return plan_similarity(store, config, workers) if dense else plan_topk(store, config, workers)


def compute_similarity(
    url: str, config: SimilarityConfig | None = None, *, storage_options: dict | None = None, **options: Any
) -> dict:
    """Compute and store the class similarity of the store at ``url``; return a summary.

    ``options`` are ``SimilarityConfig`` fields (``metric="dot"``, ``top_k=5``, ``dense=False``,
    ...), checked like the command line's. Refuses incomplete stores, naming the missing rows.
    """
    from classgrad.service.driver_runtime.progress import Progress

    if config is None:
        config = validated(SimilarityConfig, "similarity", **options)
    elif options:
        config = validated(SimilarityConfig, "similarity", **{**config.model_dump(), **options})
    if config.executor == "ray" and url.startswith("memory://"):
        raise ConfigError(
            f"store {url} lives in this process's memory, where Ray tasks cannot "
            f"see it; use the local executor (--local)"
        )
    store = open_store(url, storage_options=storage_options, mode="r+")
    missing = store.missing_ranges()
    if missing:
        raise StoreIncompleteError(
            f"store {url} is incomplete: rows {fmt_ranges(missing)} are not written yet (their "
            f"shards are not marked done); finish the job (rerun `classgrad run`) first"
        )
    if store.num_classes < 2:
        raise StoreError(f"store {url} has {store.num_classes} class; similarity needs two")
    caveat = neighbour_caveat(store.attrs.get("projection"))
    if caveat:
        log.warning("store %s: %s", url, caveat)
    dense = wants_dense(config, store.num_classes)
    _plan(store, config, dense)  # checks the sizes before Ray starts (minutes on a cluster)
    task_fn = strip_task if dense else topk_task
    run_id = new_run_id("similarity")
    session = ray_session(config.address, option="--address") if config.executor == "ray" else None
    with session if session is not None else nullcontext() as ray:
        workers = 1
        if ray is not None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1) // config.num_cpus))
        plan = _plan(store, config, dense, workers)
        bound = plan.memory_bound()
        tasks: list[tuple] = (
            [(a, b, (c0, c1)) for a, b, c0, c1 in plan.tasks()]
            if isinstance(plan, TopKPlan) and plan.part_rows
            else list(plan.blocks())
        )
        log.info(
            "similarity (%s, %s) of %d classes x %d: %d tasks of <= %d rows%s, bands of %d columns, "
            "<= %.1f MiB per task%s",
            plan.metric,
            "dense" if dense else f"top-{plan.top_k} only",
            plan.num_classes,
            plan.dim,
            len(tasks),
            plan.block_rows,
            f" x <= {plan.part_rows} candidates" if isinstance(plan, TopKPlan) and plan.part_rows else "",
            plan.band_cols,
            bound["total"] / MIB,
            f", the store read {plan.passes()} times" if isinstance(plan, TopKPlan) else "",
        )
        reports: list[dict] = []
        progress = Progress(plan.num_classes, label="similarity")
        last_renew = [time.monotonic()]

        def renew() -> None:
            now = time.monotonic()
            if now - last_renew[0] >= min(10.0, config.lease_ttl_s / 4):
                store.lease.renew(run_id)
                last_renew[0] = now
            progress.tick()

        merger = PartMerger(plan) if isinstance(plan, TopKPlan) and plan.part_rows else None

        def done(report: dict) -> None:
            reports.append(report)
            if merger is None:
                progress.update(report["stop"] - report["start"])
            elif (block := merger.add(report)) is not None:  # a block's last part: its neighbours
                start, index, value = block
                store.similarity_arrays.write_neighbours(start, index, value, run_id=run_id)
                progress.update(len(index))

        t0 = time.perf_counter()
        store.lease.acquire(run_id, ttl_s=config.lease_ttl_s, info={"command": "similarity", "metric": plan.metric})
        try:
            store.similarity_arrays.begin(
                metric=plan.metric,
                top_k=plan.top_k,
                chunk_rows=plan.chunk_rows,
                run_id=run_id,
                dense=dense,
                info={
                    "block_rows": plan.block_rows,
                    "band_cols": plan.band_cols,
                    "precision": plan.precision,
                    "tasks": len(tasks),
                    "executor": config.executor,
                    "memory_bound_bytes": bound["total"],
                    **(
                        {}
                        if isinstance(plan, SimilarityPlan)
                        else {
                            "stream_rows": plan.stream_rows,
                            "window_rows": plan.window,
                            "part_rows": plan.part_rows or plan.num_classes,
                            "passes": plan.passes(),
                        }
                    ),
                },
            )
            # A local path made absolute: a Ray worker's working directory is not the driver's.
            args = (store.local_path or url, storage_options, asdict(plan), run_id)
            if ray is not None:
                run_ray(ray, task_fn, args, tasks, config, renew, done)
            else:
                run_local(task_fn, args, tasks, renew, done)
            seconds = time.perf_counter() - t0
            summary = _summary(store, plan, config, reports, seconds, bound)
            store.similarity_arrays.finish(
                run_id,
                {
                    "seconds": seconds,
                    "read_bytes": summary["read_bytes"],
                    "peak_task_rss_added_bytes": summary["peak_task_rss_added_bytes"],
                },
            )
        finally:
            progress.close()
            store.lease.release(run_id)
    summary["run_id"] = run_id
    return summary


def _summary(
    store, plan: SimilarityPlan | TopKPlan, config: SimilarityConfig, reports: list[dict], seconds: float, bound: dict
) -> dict:
    stream_rows = plan.stream_rows if isinstance(plan, TopKPlan) else None
    return {
        "store": store.url,
        "metric": plan.metric,
        "dense": stream_rows is None,
        "top_k": plan.top_k,
        "num_classes": plan.num_classes,
        "dim": plan.dim,
        "block_rows": plan.block_rows,
        "stream_rows": stream_rows,
        "window_rows": plan.window if isinstance(plan, TopKPlan) else None,
        "part_rows": (plan.part_rows or plan.num_classes) if isinstance(plan, TopKPlan) else None,
        # how many times each row was read (dense: once per task, its own block included)
        "passes": plan.passes() if isinstance(plan, TopKPlan) else len(plan.blocks()),
        "band_cols": plan.band_cols,
        "chunk_rows": plan.chunk_rows,
        "precision": plan.precision,
        "executor": config.executor,
        "tasks": len(reports),
        "seconds": seconds,
        "read_bytes": int(sum(r["read_bytes"] for r in reports)),
        "memory_bound_bytes": bound["total"],
        "memory_bound_parts": bound,
        "peak_task_rss_added_bytes": int(max((r["rss_added"] for r in reports), default=0)),
        "peak_task_rss_bytes": int(max((r["rss_peak"] for r in reports), default=0)),
        "task_reports": sorted(reports, key=lambda r: r["start"]),
    }
