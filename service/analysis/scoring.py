"""Class scores of query rows against a store's rows (``classgrad score``): the options, the
plan and the unit of work, out of core whatever the number of queries Q and classes C.

Holds ``ScoreConfig`` (the options; defaults live here), ``ScorePlan`` (query blocks, class
blocks, column bands and the memory bound of one task), ``plan_scores``, ``score_block`` (one
query block's top-k, and its full score rows when asked, from any row readers) and
``score_task`` (what Ray or this process runs: open the stores, score, write or return).

How it works. Task i holds its query block (``block_rows`` queries of every store, already
normalised for ``cosine`` and multiplied by the damped inverse Gram for ``trak`` in the
``features`` form) and streams every store's rows past it in class blocks of ``stream_rows``
rows (in column bands when full rows would not fit): scores = sum over stores of
``weight_s * Q_s S_s^T`` (``block_rows x stream_rows``), merged into each query's running top-k
by ``similarity_topk.merge_topk`` (no self to exclude), and, when every score is asked for,
written as one chunk of the output. Nothing Q x C exists in a task. The ``kernel`` form of
``trak`` (C < k) needs a query's dot products with all C rows before its scores: a task keeps
its block's ``block_rows x C`` dot products (per store), then multiplies them by ``(K +
lambda I)^-1`` (C x C, which ``score_precondition`` bounds). Products are float32, the
damped inverse and the kernel form's products float64; scores are stored float32.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from classgrad.config.fields import Float32Number, MemoryMiB
from classgrad.errors import ConfigError, InputError
from classgrad.service.analysis import MIB, ceil_div, spans
from classgrad.service.analysis.memory import PeakMemory
from classgrad.service.analysis.similarity_topk import merge_topk
from classgrad.store import open_store
from classgrad.store.analysis.score_output import ScoreOutput

METHODS = ("dot", "cosine", "trak")
_SLACK_BYTES = 32 * MIB


class ScoreConfig(BaseModel):
    """Options of ``classgrad score`` and ``classgrad.score`` (defaults in one place)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN options: refused in one line

    method: Literal["dot", "cosine", "trak"] = Field(
        "trak", description="dot products of query and class rows, their cosine, or TRAK's g^T (Phi^T Phi + l I)^-1 phi"
    )
    top_k: int = Field(10, ge=1, description="best classes kept per query; clamped to C")
    damping: float | None = Field(
        None, ge=0, description="trak: the absolute lambda (default: damping_fraction x mean eigenvalue)"
    )
    damping_fraction: float = Field(
        0.1, gt=0, description="trak: lambda as this fraction of the Gram matrix's mean eigenvalue (trace / min(C, k))"
    )
    weights: list[Float32Number] | None = Field(
        None,
        description="one weight per store (several checkpoints: scores summed, e.g. weighted by learning rate); "
        "each within float32's range, as the scores it multiplies",
    )
    full: bool = Field(False, description="also write every query x class score into the output (needs out)")
    task_mb: MemoryMiB = Field(
        512.0, description="memory budget in MiB of one task, from which its block sizes are chosen"
    )
    block_rows: int | None = Field(
        None, ge=1, description="queries per task (default: from task_mb, >= 2 tasks per CPU)"
    )
    precond_mb: MemoryMiB = Field(
        1024.0, description="trak: the largest preconditioner (k x k or C x C float64) accepted, in MiB"
    )
    recompute_preconditioner: bool = Field(False, description="trak: compute and save the store's Gram matrix again")
    overwrite: bool = Field(False, description="replace an output made by another request")
    executor: Literal["auto", "ray", "local"] = Field(
        "auto", description="Ray tasks, this process, or auto: Ray when Q x C x k exceeds 2e11 multiply-adds"
    )
    address: str | None = Field(None, description="Ray address to join (default: as `classgrad similarity`)")
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per Ray task")
    tasks_per_cpu: int = Field(2, ge=1, description="automatic block_rows leaves at least this many tasks per CPU")


@dataclass(frozen=True)
class ScorePlan:
    """What every score task needs to know; plain data, so it travels to Ray tasks as a dict."""

    num_queries: int
    num_classes: int
    dim: int
    num_stores: int
    block_rows: int
    stream_rows: int
    band_cols: int
    top_k: int
    method: str
    form: str | None  # trak: "features" or "kernel"; None otherwise
    full: bool

    def blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_queries, self.block_rows)

    def stream_blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.stream_rows)

    def bands(self) -> list[tuple[int, int]]:
        return spans(0, self.dim, self.band_cols)

    def memory_bound(self) -> dict[str, int]:
        """Bytes one task may hold at its peak, by part, and their ``total``."""
        B, M, W, D, C, S = (
            self.block_rows,
            self.stream_rows,
            self.band_cols,
            self.dim,
            self.num_classes,
            self.num_stores,
        )
        kernel = self.form == "kernel"
        parts = {
            "queries": 2 * S * B * D * 4 + (B * W * 4 if W < D else 0),  # as received, and a copy
            "stream": M * W * (4 + 4 + 4),  # decoded chunks, the gathered block, its contiguous copy
            "scores": 2 * B * M * 4,  # the block's sum and one store's product
            "topk": B * 8 * self.top_k * 12,
            "kernel": (S * B * C * 8 + C * C * 8 + B * C * 8) if kernel else 0,
            "slack": _SLACK_BYTES,
        }
        parts["total"] = sum(parts.values())
        return parts


def plan_scores(
    num_queries: int, store: Any, config: ScoreConfig, *, num_stores: int, form: str | None, workers: int = 1
) -> ScorePlan:
    """Block sizes within ``config.task_mb`` MiB per task; refuses (one line) a budget too small."""
    Q, C, D, rc = num_queries, store.num_classes, store.dim, store.row_chunk
    k = min(config.top_k, C)
    budget = int(config.task_mb * MIB) - _SLACK_BYTES
    kernel_fixed = C * C * 8 if form == "kernel" else 0
    per_query = 2 * num_stores * D * 4 + 96 * k + (num_stores * C * 8 + C * 8 if form == "kernel" else 0)
    avail = budget - kernel_fixed
    if config.block_rows is not None:
        rows = min(config.block_rows, Q)
    else:
        parallel = ceil_div(Q, config.tasks_per_cpu * workers) if workers > 1 else Q
        rows = max(1, min(parallel, max(avail // 2, 0) // per_query, Q))
    rest = avail - rows * per_query
    width = D
    stream = min(C, max(rest, 0) // (width * 12 + rows * 8) // rc * rc)
    if stream < min(rc, C):  # full rows do not fit beside the queries: bands of whole column chunks
        cc = store.col_chunk
        width = min(D, max(rest - rc * rows * 8, 0) // (rc * 12 + rows * 4) // cc * cc)
        stream = rc if width > 0 else 0
    if stream < 1 or width < 1 or rest < 0:
        kernel = " and the C x C kernel" if form == "kernel" else ""
        raise ConfigError(
            f"score: --task-mb {config.task_mb:g} cannot hold {rows} queries of {D} columns beside a block of "
            f"{rc} class rows{kernel}; raise --task-mb or lower --block-rows"
        )
    return ScorePlan(
        num_queries=Q,
        num_classes=C,
        dim=D,
        num_stores=num_stores,
        block_rows=rows,
        stream_rows=int(min(stream, C)),
        band_cols=int(width),
        top_k=k,
        method=config.method,
        form=form,
        full=config.full,
    )


def _norms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.square(x, dtype=np.float64).sum(axis=1))


def _check_finite(scores) -> None:
    """Refuse scores that overflowed float32 (before any is written): large weights, or rows and
    queries whose products leave its range, would rank by inf and NaN."""
    if not bool(scores.isfinite().all()):
        raise InputError(
            "score: query x class scores overflow float32 (with --weights, or rows and queries this large); "
            "lower --weights, or scale the queries down"
        )


def score_block(readers: list[Any], queries: np.ndarray, weights: list[float], plan: ScorePlan, kinv=None, emit=None):
    """Top-k of one query block: (rows int64 [n, k], scores float32 [n, k]).

    ``readers[s](a, b, (c0, c1))`` gives store s's rows [a, b) x columns [c0, c1) as float32;
    ``queries`` float32 [stores, n, D], prepared (normalised for cosine, transformed for trak
    features); ``kinv`` [stores] of C x C float64 (kernel form); ``emit(j0, scores)`` receives
    each class block's float32 scores [n, j1 - j0] when every score is wanted."""
    import torch

    C, k = plan.num_classes, plan.top_k
    n = queries.shape[1]
    best_val = torch.full((n, k), float("-inf"), dtype=torch.float32)
    best_idx = torch.full((n, k), C, dtype=torch.int64)
    bands = plan.bands()
    # A Ray argument arrives read-only (shared memory): a copy that torch may own.
    q = torch.from_numpy(np.ascontiguousarray(queries if queries.flags.writeable else queries.copy(), dtype=np.float32))
    kernel = plan.form == "kernel"
    dots = np.zeros((len(readers), n, C), dtype=np.float64) if kernel else None
    for j0, j1 in plan.stream_blocks():
        total = torch.zeros(n, j1 - j0, dtype=torch.float32)
        for s, read in enumerate(readers):
            part = torch.zeros(n, j1 - j0, dtype=torch.float32)
            ssq = np.zeros(j1 - j0, dtype=np.float64) if plan.method == "cosine" else None
            for c0, c1 in bands:
                rows = read(j0, j1, (c0, c1))
                if ssq is not None:
                    ssq += np.square(rows, dtype=np.float64).sum(axis=1)
                qb = q[s] if len(bands) == 1 else q[s, :, c0:c1].contiguous()
                part.addmm_(qb, torch.from_numpy(rows).T)
                del rows
            if ssq is not None:
                inv = np.divide(1.0, np.sqrt(ssq), out=np.zeros_like(ssq), where=ssq > 0)
                part.mul_(torch.from_numpy(inv.astype(np.float32))[None, :])
            if dots is not None:
                dots[s, :, j0:j1] = part.numpy()
            else:
                total.add_(part, alpha=float(weights[s]))
        if kernel:
            continue
        _check_finite(total)
        if emit is not None:
            emit(j0, total.numpy())
        best_val, best_idx = merge_topk(best_val, best_idx, total, j0, C, k)  # row0 = C: no self to exclude
    if dots is not None:
        assert kinv is not None
        scores = sum(float(w) * (dots[s] @ kinv[s]) for s, w in enumerate(weights))
        for j0, j1 in plan.stream_blocks():
            block = torch.from_numpy(np.ascontiguousarray(scores[:, j0:j1], dtype=np.float32))
            _check_finite(block)
            if emit is not None:
                emit(j0, block.numpy())
            best_val, best_idx = merge_topk(best_val, best_idx, block, j0, C, k)
    return best_idx.numpy(), best_val.numpy()


def score_task(
    urls: list[str],
    storage_options: dict | None,
    plan: dict,
    a: int,
    b: int,
    queries: np.ndarray,
    weights: list[float],
    kinv: Any,
    out: str | None,
    block: int,
) -> dict:
    """One task: queries [a, b) scored against every store; written into ``out`` (and marked
    done) when given, else returned. Returns a small report (and the top-k without ``out``)."""
    import torch  # noqa: F401 - imported before the meter starts: the import is not the work's

    meter = PeakMemory()
    t0, cpu0 = time.perf_counter(), time.process_time()
    result: dict[str, Any] = {}
    try:
        p = ScorePlan(**plan)
        stores = [open_store(u, storage_options=storage_options) for u in urls]
        target = ScoreOutput.open(out, storage_options, mode="r+") if out else None
        emit = None
        if target is not None and p.full:
            emit = lambda j0, values: target.write_scores(a, j0, values)  # noqa: E731
        rows, scores = score_block([s.block for s in stores], queries, weights, p, kinv, emit)
        class_ids = np.asarray(stores[0].class_ids)[np.minimum(rows, p.num_classes - 1)]
        if target is not None:
            target.write_topk(a, rows, class_ids, scores)
            target.mark_done(block)
        else:
            result = {"rows": rows, "scores": scores}
    finally:
        peak = meter.close()
    return {
        **result,
        "start": a,
        "stop": b,
        "block": block,
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
        "rss_start": meter.start,
        "rss_peak": peak,
        "rss_added": peak - meter.start,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
