"""Top-k class similarity without the C x C matrix: each class's k most similar classes (cosine
or dot), streamed block by block, for stores whose dense matrix would be too large to keep.

Holds ``TopKPlan`` (query blocks, stream blocks, column bands, the table's chunk rows and the
memory bound of one task), ``plan_topk`` (sizes from a per-task memory budget),
``merge_topk`` (one block of scores merged into the running top-k: the unit the unit tests
check), ``streamed_topk`` (one query block's top-k from any row reader) and ``topk_task`` (the
unit of work Ray or this process runs: read, compute, write the block's neighbours, report).

How it works. Task i holds the rows of its query block Q (block_rows x D, normalised for
cosine) and streams every row of the store past it in stream blocks S of stream_rows rows (read
in column bands when a block of full rows would not fit): scores = Q S^T (block_rows x
stream_rows; for cosine scaled by 1 / |s| per column), then ``merge_topk`` keeps each query
row's k best of (its running k best, this block's candidates). Nothing C-wide exists in a
task: it holds Q, one stream block, one score block and k neighbours per query row, whatever C
is, so query blocks can be far larger than the dense path's strips and each row is read about
C / block_rows times instead of C / (a strip's rows). Self is excluded (its score set to -inf);
equal scores go to the lower row index, as in the dense path, so the table is deterministic.
Products are float32 (``precision="float64"`` computes in float64); values are stored float32.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from classgrad.service.analysis import MIB, ceil_div, spans
from classgrad.service.analysis.memory import PeakMemory
from classgrad.service.errors import ConfigError

# A neighbour-table chunk (chunk_rows x k int64) stays below this many bytes.
_TABLE_CHUNK_BYTES = 8 * MIB
# The interpreter's own small allocations, torch's and zarr's buffers for small arrays.
_SLACK_BYTES = 16 * MIB

Reader = Callable[[int, int, tuple[int, int]], np.ndarray]


def _topk_row_bytes(k: int) -> int:
    """Scratch of the running top-k per query row: the running k best, a block's k candidates,
    their 2k concatenation, its two orderings and the argsort indices (values and int64)."""
    return 8 * k * 12


@dataclass(frozen=True)
class TopKPlan:
    """What every top-k task needs to know; plain data, so it travels to Ray tasks as a dict."""

    num_classes: int
    dim: int
    block_rows: int
    stream_rows: int
    band_cols: int
    chunk_rows: int
    metric: str
    top_k: int
    precision: str

    def blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.block_rows)

    def stream_blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.stream_rows)

    def bands(self) -> list[tuple[int, int]]:
        return spans(0, self.dim, self.band_cols)

    def memory_bound(self) -> dict[str, int]:
        """Bytes one task may hold at its peak, by part, and their ``total``: the query block
        (and its float32 read when computing in float64), one stream block as read and in the
        arithmetic's dtype (plus a contiguous copy of the query's band when banded), one block
        of scores, the running top-k and a fixed slack (which also covers the stable sort of
        one row of scores where ties straddle the k-th place)."""
        B, M, W, D = self.block_rows, self.stream_rows, self.band_cols, self.dim
        item = 8 if self.precision == "float64" else 4
        parts = {
            "query": B * D * item + (B * D * 4 if item == 8 else 0),
            "stream": M * W * (4 + 4 + item),  # decoded chunks, the gathered block, its cast
            "query_band": B * W * item if W < D else 0,
            "scores": B * M * item,
            "topk": B * _topk_row_bytes(self.top_k),
            "slack": _SLACK_BYTES,
        }
        parts["total"] = sum(parts.values())
        return parts


def _round_down(value: int, unit: int) -> int:
    return value - value % unit


def _table_chunk_rows(block_rows: int, row_chunk: int, k: int) -> int:
    """Largest multiple of row_chunk dividing block_rows whose table chunk stays small."""
    best = row_chunk
    for d in range(1, block_rows // row_chunk + 1):
        rows = d * row_chunk
        if block_rows % rows == 0 and rows * max(k, 1) * 8 <= _TABLE_CHUNK_BYTES:
            best = rows
    return best


def plan_topk(store, config: Any, workers: int = 1) -> TopKPlan:
    """Query rows, stream rows and column bands for ``store`` within ``config.task_mb`` MiB per
    task (``config`` is a ``SimilarityConfig``): the query block takes at most half of the
    budget and is capped so that there are ``tasks_per_cpu`` tasks per worker; stream blocks
    take what is left. A given ``block_rows`` (a multiple of the store's row_chunk) or
    ``band_cols`` is used as given."""
    C, D, rc, cc = store.num_classes, store.dim, store.row_chunk, store.col_chunk
    k = min(config.top_k, C - 1)
    item = 8 if config.precision == "float64" else 4
    budget = int(config.task_mb * MIB)
    avail = budget - _SLACK_BYTES
    per_query = D * item + (D * 4 if item == 8 else 0) + _topk_row_bytes(k)
    all_rows = ceil_div(C, rc) * rc
    if config.block_rows is not None:
        if config.block_rows < 1 or config.block_rows % rc:
            raise ConfigError(
                f"--block-rows must be a positive multiple of the store's row_chunk ({rc}), got {config.block_rows}"
            )
        rows = min(config.block_rows, all_rows)
    else:
        parallel = ceil_div(ceil_div(C, config.tasks_per_cpu * workers), rc) * rc if workers > 1 else all_rows
        rows = max(rc, min(parallel, _round_down(max(avail // 2, 0) // per_query, rc)))
    rest = avail - rows * per_query

    def stream_for(w: int) -> int:
        """Stream rows that fit beside the query block when read in bands of w columns."""
        left = rest - (rows * w * item if w < D else 0)  # the query's band copy
        per_stream = w * (8 + item) + rows * item
        return min(all_rows, _round_down(max(left, 0) // per_stream, rc))

    width = min(config.band_cols, D) if config.band_cols is not None else D
    stream = stream_for(width)
    if stream < rc and config.band_cols is None:
        # Full rows do not fit: stream row_chunk rows at a time, in bands of whole column chunks.
        spare = rest - rc * rows * item
        width = min(D, _round_down(max(spare, 0) // (rc * (8 + item) + rows * item), cc))
        stream = stream_for(width) if width > 0 else 0
    if stream < rc or width < 1:
        need = _SLACK_BYTES + rows * per_query + rc * rows * item + min(D, cc) * (rc * (8 + item) + rows * item)
        raise ConfigError(
            f"top-k similarity: --task-mb {config.task_mb:g} cannot hold a query block of {rows} rows x "
            f"{D} columns beside a stream block of {rc} rows; raise --task-mb to at least "
            f"{ceil_div(need, MIB)} or lower --block-rows"
        )
    return TopKPlan(
        num_classes=C,
        dim=D,
        block_rows=rows,
        stream_rows=stream,
        band_cols=width,
        chunk_rows=min(_table_chunk_rows(rows, rc, k), C),  # above C only when one block holds all rows
        metric=config.metric,
        top_k=k,
        precision=config.precision,
    )


# --------------------------------------------------------------------------- the merge


def merge_topk(best_val, best_idx, scores, col0: int, row0: int, k: int):
    """Merge one block of scores into the running top-k of its query rows.

    ``best_val`` / ``best_idx`` [B, k] (torch; best first, equal values by lower index; start
    with -inf / ``C``), ``scores`` [B, M] (torch; modified: the diagonal of rows that are also
    columns is set to -inf) for query rows row0.. and columns col0..; returns the new
    (values, indices), best first, equal values by lower index. The block's own candidates
    are its k best with ties at the k-th value resolved to the lower index, so no entry
    dropped here could have been among the k best overall."""
    import torch

    B, M = scores.shape
    lo, hi = max(row0, col0), min(row0 + B, col0 + M)
    if lo < hi:  # self is never its own neighbour
        r = torch.arange(lo, hi)
        scores[r - row0, r - col0] = float("-inf")
    kk = min(k, M)
    # One more than needed: where the (k+1)-th best equals the k-th, torch.topk may have picked
    # among equal values arbitrarily; those rows (rare but for ties) are redone with a stable
    # sort, which puts the lower column first.
    val, pos = torch.topk(scores, min(kk + 1, M), dim=1)
    if kk < M:
        for i in torch.nonzero(val[:, kk] == val[:, kk - 1]).flatten().tolist():
            order = torch.sort(scores[i], descending=True, stable=True).indices[:kk]
            pos[i, :kk], val[i, :kk] = order, scores[i, order]
        val, pos = val[:, :kk], pos[:, :kk]
    merged_val = torch.cat([best_val, val.to(best_val.dtype)], dim=1)
    merged_idx = torch.cat([best_idx, pos + col0], dim=1)
    by_index = torch.argsort(merged_idx, dim=1, stable=True)
    merged_val, merged_idx = merged_val.gather(1, by_index), merged_idx.gather(1, by_index)
    by_value = torch.argsort(merged_val, dim=1, descending=True, stable=True)[:, :k]
    return merged_val.gather(1, by_value), merged_idx.gather(1, by_value)


def _squared_norms(x) -> Any:
    """|row|^2 in float64, summed a few rows at a time (bounds the float64 copy)."""
    import torch

    sq = torch.zeros(x.shape[0], dtype=torch.float64)
    for r in range(0, x.shape[0], 256):
        sq[r : r + 256] = x[r : r + 256].double().square().sum(dim=1)
    return sq


def streamed_topk(read: Reader, plan: TopKPlan, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The top-k neighbours of rows [start, stop): (row indices int64 [n, k], values float32
    [n, k], bytes of float32 values read). ``read(a, b, (c0, c1))`` returns rows [a, b) x
    columns [c0, c1) as float32 numpy (the store's ``block``)."""
    import torch

    dtype = torch.float64 if plan.precision == "float64" else torch.float32
    C, D, k = plan.num_classes, plan.dim, plan.top_k
    cosine = plan.metric == "cosine"
    q = torch.from_numpy(read(start, stop, (0, D))).to(dtype)
    read_bytes = q.shape[0] * D * 4
    if cosine:
        sq = _squared_norms(q)
        inv = torch.where(sq > 0, sq.rsqrt(), torch.zeros_like(sq))
        q.mul_(inv.to(dtype)[:, None])
    n = stop - start
    best_val = torch.full((n, k), float("-inf"), dtype=dtype)
    best_idx = torch.full((n, k), C, dtype=torch.int64)
    buffer = torch.empty(n * plan.stream_rows, dtype=dtype)  # one block of scores, reused
    bands = plan.bands()
    for j0, j1 in plan.stream_blocks():
        scores = buffer[: n * (j1 - j0)].view(n, j1 - j0)
        ssq = torch.zeros(j1 - j0, dtype=torch.float64) if cosine else None
        for b, (c0, c1) in enumerate(bands):
            s = torch.from_numpy(read(j0, j1, (c0, c1))).to(dtype)
            read_bytes += s.shape[0] * (c1 - c0) * 4
            if ssq is not None:
                ssq += _squared_norms(s)
            qb = q if len(bands) == 1 else q[:, c0:c1].contiguous()
            if b == 0:
                torch.mm(qb, s.T, out=scores)
            else:
                scores.addmm_(qb, s.T)
            del s, qb
        if ssq is not None:
            inv_s = torch.where(ssq > 0, ssq.rsqrt(), torch.zeros_like(ssq))
            scores.mul_(inv_s.to(dtype)[None, :])
        best_val, best_idx = merge_topk(best_val, best_idx, scores, j0, start, k)
    return best_idx.numpy(), best_val.to(torch.float32).numpy(), read_bytes


def topk_task(url: str, storage_options: dict | None, plan: dict, start: int, stop: int, run_id: str) -> dict:
    """One task: the top-k neighbours of rows [start, stop) from the store, written into it;
    returns a small report (rows, seconds, bytes read, memory) like the dense task's."""
    import torch  # noqa: F401 - imported before the meter starts: the import is not the work's

    from classgrad.service.store import open_store

    meter = PeakMemory()
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        p = TopKPlan(**plan)
        store = open_store(url, storage_options=storage_options, mode="r+")
        index, value, read = streamed_topk(store.block, p, start, stop)
        store.similarity_arrays.write_neighbours(start, index, value, run_id=run_id)
        del index, value
    finally:
        peak = meter.close()
    return {
        "start": start,
        "stop": stop,
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,  # this process's CPU time: what load does not change
        "read_bytes": read,
        "rss_start": meter.start,
        "rss_peak": peak,
        "rss_added": peak - meter.start,
        "exact_peak": meter.exact,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
