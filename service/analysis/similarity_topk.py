"""Top-k class similarity without the C x C matrix: each class's k most similar classes (cosine
or dot), streamed block by block, for stores whose dense matrix would be too large to keep.

Holds ``TopKPlan`` (query blocks, score windows, stream reads, column bands, the table's chunk
rows, the memory bound of one task and how many times each row is read), ``plan_topk`` (sizes
from a per-task memory budget), ``merge_topk`` (one block of scores merged into the running
top-k: the unit the unit tests check), ``streamed_topk`` (one query block's top-k from any row
reader) and ``topk_task`` (the unit of work Ray or this process runs: read, compute, write the
block's neighbours, report).

How it works. Task i owns query block Q (block_rows rows) and computes its scores against every
row of the store, one window of window_rows rows at a time: scores = Q S^T (block_rows x
window_rows), summed over column bands when rows are read in bands; then ``merge_topk`` keeps
each query row's k best of (its running k best, the window's candidates). The window's rows are
read in stream blocks of stream_rows rows x one band, each into one reused buffer, a few row
chunks per read (read_rows: one read in flight decodes about 4 MiB, however large the block);
Q is read once (full rows) or once per window and band (banded), in reads of the same size. So a task
holds Q or one band of it, one stream buffer, one read in flight (zarr's decoded chunks and the
values as returned), one window of scores and k neighbours per query row, whatever C is; and
each row of the store is read ``passes`` times in all (once by each task, and its own block's
query read: ``TopKPlan.passes``). A window of scores costs block_rows x window_rows while a
band of Q costs block_rows x band_cols: for wide rows (many parameters, few classes) bands let
the query block, and so each task's share of the rows, be far larger than full rows would, and
the number of passes far smaller. Self is excluded (its score set to -inf); equal scores go to
the lower row index, as in the dense path, so the table is deterministic. For cosine the scores
are scaled by 1 / (|q| |s|) (norms summed in float64; rows of norm 0 score 0). Products are
float32 (``precision="float64"`` computes in float64); values are stored float32.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from classgrad.errors import ConfigError
from classgrad.service.analysis import MIB, ceil_div, spans
from classgrad.service.analysis.memory import PeakMemory
from classgrad.store import open_store

# A neighbour-table chunk (chunk_rows x k int64) stays below this many bytes.
_TABLE_CHUNK_BYTES = 8 * MIB
# The interpreter's own small allocations, torch's and zarr's buffers for small arrays, and what
# opening the store and its first reads and writes cost in a fresh process (zarr's codec
# pipeline, its threads and their allocator arenas). It varies from run to run with how the
# decoding threads' allocations fall: tests/unit/test_topk_memory.py's first banded task,
# whose other parts are bounded by 7.6 MiB, peaked at 31.8 MiB in one fresh-clone run of the
# suite (a fixed part of up to 24.2 MiB) and at 24.5-25.1 MiB in three runs of
# ``benchmarks.topk_wide --classes 256 --dim 12800 --task-mb 36 --col-chunk 1600``.
_SLACK_BYTES = 28 * MIB
# One read in flight holds about this many copies of what it decodes: zarr's compressed and
# decoded chunks, the float32 values it returns and the reader's NaN check (a quarter: booleans);
# measured 3 for a 64-row read of full rows (+19.5 MiB beside a 9.8 MiB result); counted 6 for
# the NaN check and what zarr's decoding threads keep in their own allocator arenas in a fresh
# process (a banded run of 600 x 40,000 rows in 4,000-column chunks measured 2.4 MiB over a
# bound counting 4: benchmarks/topk_wide.py, benchmarks/RESULTS.md).
_READ_COPIES = 6
# One read decodes at most about this much (at least one row chunk of a band; at most 1/16 of a
# small budget): the stream buffer
# a product uses can be far larger, filled by several reads, so that the products stay wide
# enough to run at BLAS speed (a 16-row stream block made them memory-bound on the query block).
_READ_PIECE_BYTES = 4 * MIB
# Stream reads take at most this share of the budget (more only buys fewer, larger reads).
_STREAM_SHARE = 8
# The scratch of summing squared norms (the float32 squares of a few rows).
_NORM_SCRATCH_BYTES = 1 * MIB
# Stream blocks are narrowed to this many rows before one row chunk (see _fit).
_MIN_STREAM_ROWS = 64
# Columns of a band when the store's column chunk holds every column (any width then decodes
# the whole chunk, so bands are only for a query block that would not fit otherwise).
_BAND_UNIT = 256

Reader = Callable[[int, int, tuple[int, int]], np.ndarray]


def _topk_row_bytes(k: int) -> int:
    """Scratch of the running top-k per query row: the running k best, a block's k candidates,
    their 2k concatenation, its two orderings and the argsort indices (values and int64), and
    the row's squared norm and scale."""
    return 8 * k * 12 + 16


@dataclass(frozen=True)
class TopKPlan:
    """What every top-k task needs to know; plain data, so it travels to Ray tasks as a dict.
    ``window_rows`` 0 means one window of every row; ``read_cols`` 0 means ``band_cols``."""

    num_classes: int
    dim: int
    block_rows: int
    stream_rows: int
    band_cols: int
    chunk_rows: int
    metric: str
    top_k: int
    precision: str
    window_rows: int = 0
    read_cols: int = 0  # columns one read decodes (whole column chunks): its in-flight memory
    read_rows: int = 0  # rows of one read (0: stream_rows); several fill one stream block

    @property
    def window(self) -> int:
        return self.window_rows or self.num_classes

    def blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.block_rows)

    def windows(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.window)

    def stream_blocks(self) -> list[tuple[int, int]]:
        return [s for w0, w1 in self.windows() for s in spans(w0, w1, self.stream_rows)]

    def bands(self) -> list[tuple[int, int]]:
        return spans(0, self.dim, self.band_cols)

    def passes(self) -> int:
        """How many times each row is read in all (values of every column; a banded query block
        is read again for each window)."""
        banded = self.band_cols < self.dim
        return len(self.blocks()) + (len(self.windows()) if banded else 1)

    def memory_bound(self) -> dict[str, int]:
        """Bytes one task may hold at its peak, by part, and their ``total``: the query block
        (full rows, or one band of them), the stream buffer, one read in flight (``_READ_COPIES``
        copies of what it decodes), one product of the query block and a stream read when a
        window takes several reads, one window of scores (four times: ``torch.topk`` works on
        copies), the running top-k, the float64 scratch of the squared norms and a fixed slack
        (which also covers the stable sort of one row of scores where ties straddle the k-th
        place)."""
        B, M, W, D = self.block_rows, self.stream_rows, self.band_cols, self.dim
        item = 8 if self.precision == "float64" else 4
        window = min(self.window, self.num_classes)
        parts = {
            "query": B * (D if W >= D else W) * item,
            "stream": M * W * item,
            "read_in_flight": _READ_COPIES * min(self.read_rows or M, M) * (self.read_cols or W) * 4,
            "product": B * M * item if M < window else 0,
            # the window, and torch.topk's working copies of it (3 measured: a 608 x 600 merge took
            # +3.3 MiB beside its 1.4 MiB window)
            "scores": 4 * B * window * item + window * 16,
            "topk": B * _topk_row_bytes(self.top_k),
            "norm_scratch": 4 * (D if W >= D else W) * min(_norm_rows(D if W >= D else W), max(B, M)),
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


def _read_cols(width: int, dim: int, col_chunk: int) -> int:
    """Columns a read of ``width`` columns decodes: whole column chunks (one more when the band
    does not start on a chunk boundary), at most every column."""
    if col_chunk >= dim:
        return dim
    return min(dim, ceil_div(width, col_chunk) * col_chunk + (col_chunk if width % col_chunk else 0))


def _fit(avail: int, C: int, D: int, rc: int, cc: int, k: int, item: int, cap: int, width: int, fixed: bool):
    """(block_rows, window_rows, stream_rows, read_cols, read_rows) for bands of ``width`` columns
    within ``avail`` bytes, or None when not even one row chunk fits. One read in flight decodes
    about ``_READ_PIECE_BYTES``; the stream buffer takes at most 1 / _STREAM_SHARE of the
    budget, and is narrowed (to ``_MIN_STREAM_ROWS``, then one row chunk) only where the query
    block would not fit beside it (``fixed``: would not reach ``cap``, a given --block-rows):
    products with few stream rows run far below BLAS speed (16 rows: 6x slower than 112 on the
    dev machine). The query block is as large as it may be (up to ``cap``) with one window of
    every row, else half of what is left, the rest for the scores' window."""
    all_rows = ceil_div(C, rc) * rc
    read_cols = _read_cols(width, D, cc)
    query_cols = D if width >= D else width
    piece = min(_READ_PIECE_BYTES, max(avail, 0) // 16)  # in flight: at most 3/16 of a small budget
    read_rows = min(all_rows, max(rc, _round_down(piece // (read_cols * 4), rc)))
    avail -= _NORM_SCRATCH_BYTES + 4 * query_cols

    def rest_beside(stream: int) -> int:  # what is left beside a stream buffer and its reads
        return avail - stream * width * item - _READ_COPIES * min(read_rows, stream) * read_cols * 4

    shared = min(all_rows, _round_down(max(avail, 0) // _STREAM_SHARE // (width * item), rc))
    narrower = [m for m in (_round_down(_MIN_STREAM_ROWS, rc), rc) if m < shared]
    need = cap if fixed else min(cap, rc)
    for stream in dict.fromkeys([max(shared, rc), *narrower]):
        rest = rest_beside(stream)
        per_query = query_cols * item + _topk_row_bytes(k) + stream * item  # + its product
        rows = min(cap, _round_down(max(rest - all_rows * 16, 0) // (per_query + 4 * all_rows * item), rc))
        if rows >= need and rows > 0:
            return rows, 0, stream, read_cols, min(read_rows, stream)
    stream = rc
    rest = rest_beside(stream)
    per_query = query_cols * item + _topk_row_bytes(k) + stream * item
    rows = min(cap, _round_down(max(rest, 0) // 2 // per_query, rc))
    if rows < rc:
        return None
    window = _round_down(max(rest - rows * per_query, 0) // (4 * rows * item + 16), rc)
    if window < stream:
        return None
    return rows, window, stream, read_cols, min(read_rows, stream)


def plan_topk(store, config: Any, workers: int = 1) -> TopKPlan:
    """Query rows, score windows, stream reads and column bands for ``store`` within
    ``config.task_mb`` MiB per task (``config`` is a ``SimilarityConfig``). The query block is
    capped so that there are ``tasks_per_cpu`` tasks per worker; full rows are read unless
    column bands (whole column chunks) allow a larger query block, and so fewer passes over
    the store, or full rows do not fit at all. A given ``block_rows`` (a multiple of the
    store's row_chunk) or ``band_cols`` is used as given."""
    C, D, rc, cc = store.num_classes, store.dim, store.row_chunk, store.col_chunk
    k = min(config.top_k, C - 1)
    item = 8 if config.precision == "float64" else 4
    budget = int(config.task_mb * MIB)
    avail = budget - _SLACK_BYTES
    all_rows = ceil_div(C, rc) * rc
    if config.block_rows is not None:
        if config.block_rows < 1 or config.block_rows % rc:
            raise ConfigError(
                f"--block-rows must be a positive multiple of the store's row_chunk ({rc}), got {config.block_rows}"
            )
        cap = min(config.block_rows, all_rows)
    else:
        cap = ceil_div(ceil_div(C, config.tasks_per_cpu * workers), rc) * rc if workers > 1 else all_rows
    unit = cc if cc < D else _BAND_UNIT
    if config.band_cols is not None:
        widths = [min(config.band_cols, D)]
    else:
        widths = [D] + [w for w in (_round_down(D // n, unit) for n in (2, 4, 8, 16, 32, 64, 128)) if 0 < w < D]
        widths += [unit] if unit < D else []
    fixed = config.block_rows is not None
    fits = [
        (w, f) for w in dict.fromkeys(widths) if (f := _fit(avail, C, D, rc, cc, k, item, cap, w, fixed)) is not None
    ]
    if config.block_rows is not None:
        fits = [(w, f) for w, f in fits if f[0] == cap]
    if not fits:
        rows = cap if config.block_rows is not None else rc
        width = min(D, cc)
        need = (
            _SLACK_BYTES
            + _NORM_SCRATCH_BYTES
            + 16 * D
            + rows * (width * item + _topk_row_bytes(k) + rc * item)
            + all_rows * 16
        )
        need += rc * (width * item + _READ_COPIES * _read_cols(width, D, cc) * 4) + rows * rc * item
        raise ConfigError(
            f"top-k similarity: --task-mb {config.task_mb:g} cannot hold a query block of {rows} rows x "
            f"{D} columns beside a stream block of {rc} rows; raise --task-mb to at least "
            f"{ceil_div(need, MIB)} or lower --block-rows"
        )
    # The widest bands that fit; with column chunks narrower than a row, the bands that give the
    # fewest tasks (so the fewest passes over the store), the widest of those.
    best = fits[0] if cc >= D else min(fits, key=lambda wf: (ceil_div(C, wf[1][0]), -wf[0]))
    width, (rows, window, stream, read_cols, read_rows) = best
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
        window_rows=0 if window == 0 or window >= C else window,
        read_cols=read_cols,
        read_rows=read_rows,
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


def _norm_rows(width: int) -> int:
    """Rows whose squares (float32) stay within ``_NORM_SCRATCH_BYTES``."""
    return max(1, _NORM_SCRATCH_BYTES // (4 * max(width, 1)))


def _squared_norms(x) -> Any:
    """|row|^2, squares summed in float64, a few rows at a time: their float32 squares never
    exceed ``_NORM_SCRATCH_BYTES`` (plus one row), however wide the rows are (float64 copies
    of 256 rows at a time took 600 MiB outside the bound on 155,912 columns)."""
    import torch

    sq = torch.empty(x.shape[0], dtype=torch.float64)
    step = _norm_rows(x.shape[1])
    for r in range(0, x.shape[0], step):
        part = x[r : r + step]
        torch.sum(part * part, dim=1, dtype=torch.float64, out=sq[r : r + step])
    return sq


def _read_into(read: Reader, buffer, a: int, b: int, cols: tuple[int, int], rows_per_read: int):
    """Rows [a, b) x ``cols`` read ``rows_per_read`` rows at a time into ``buffer`` (flat, reused):
    returns the [b - a, width] view. One read is in flight at a time, so its decoding never
    holds more than one read's worth beside the buffer."""
    import torch

    width = cols[1] - cols[0]
    out = buffer[: (b - a) * width].view(b - a, width)
    for r0 in range(a, b, rows_per_read):
        r1 = min(r0 + rows_per_read, b)
        out[r0 - a : r1 - a].copy_(torch.from_numpy(read(r0, r1, cols)))
    return out


def _inverse_norms(sq):
    import torch

    return torch.where(sq > 0, sq.rsqrt(), torch.zeros_like(sq))


def streamed_topk(read: Reader, plan: TopKPlan, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The top-k neighbours of rows [start, stop): (row indices int64 [n, k], values float32
    [n, k], bytes of float32 values read). ``read(a, b, (c0, c1))`` returns rows [a, b) x
    columns [c0, c1) as float32 numpy (the store's ``block``)."""
    import torch

    dtype = torch.float64 if plan.precision == "float64" else torch.float32
    C, D, k, M = plan.num_classes, plan.dim, plan.top_k, plan.stream_rows
    R = min(plan.read_rows or M, M)  # rows of one read
    cosine = plan.metric == "cosine"
    n = stop - start
    bands = plan.bands()
    banded = len(bands) > 1
    read_bytes = 0
    query_buffer = torch.empty(n * (bands[0][1] - bands[0][0]), dtype=dtype)
    stream_buffer = torch.empty(M * (bands[0][1] - bands[0][0]), dtype=dtype)
    windows = plan.windows()
    scores_buffer = torch.empty(n * min(plan.window, C), dtype=dtype)
    product_buffer = torch.empty(n * M, dtype=dtype) if M < plan.window else None
    q = None
    q_inv = None
    if not banded:  # full rows: the query block is read once and normalised in place
        q = _read_into(read, query_buffer, start, stop, (0, D), R)
        read_bytes += n * D * 4
        if cosine:
            q.mul_(_inverse_norms(_squared_norms(q)).to(dtype)[:, None])
    best_val = torch.full((n, k), float("-inf"), dtype=dtype)
    best_idx = torch.full((n, k), C, dtype=torch.int64)
    for w, (w0, w1) in enumerate(windows):
        scores = scores_buffer[: n * (w1 - w0)].view(n, w1 - w0)
        s_sq = torch.zeros(w1 - w0, dtype=torch.float64) if cosine else None
        q_sq = torch.zeros(n, dtype=torch.float64) if cosine and banded and w == 0 else None
        for b, (c0, c1) in enumerate(bands):
            if banded:
                q = _read_into(read, query_buffer, start, stop, (c0, c1), R)
                read_bytes += n * (c1 - c0) * 4
                if q_sq is not None:
                    q_sq += _squared_norms(q)
            assert q is not None
            for j0, j1 in spans(w0, w1, M):
                s = _read_into(read, stream_buffer, j0, j1, (c0, c1), R)
                read_bytes += (j1 - j0) * (c1 - c0) * 4
                if s_sq is not None:
                    s_sq[j0 - w0 : j1 - w0] += _squared_norms(s)
                target = scores[:, j0 - w0 : j1 - w0]
                if product_buffer is None:  # one read per window: straight into the scores
                    if b == 0:
                        torch.mm(q, s.T, out=scores)
                    else:
                        scores.addmm_(q, s.T)
                    continue
                product = product_buffer[: n * (j1 - j0)].view(n, j1 - j0)
                torch.mm(q, s.T, out=product)
                if b == 0:
                    target.copy_(product)
                else:
                    target.add_(product)
        if q_sq is not None:
            q_inv = _inverse_norms(q_sq).to(dtype)
        if q_inv is not None:
            scores.mul_(q_inv[:, None])
        if s_sq is not None:
            scores.mul_(_inverse_norms(s_sq).to(dtype)[None, :])
        best_val, best_idx = merge_topk(best_val, best_idx, scores, w0, start, k)
    return best_idx.numpy(), best_val.to(torch.float32).numpy(), read_bytes


def topk_task(url: str, storage_options: dict | None, plan: dict, start: int, stop: int, run_id: str) -> dict:
    """One task: the top-k neighbours of rows [start, stop) from the store, written into it;
    returns a small report (rows, seconds, bytes read, memory) like the dense task's."""
    import torch  # noqa: F401 - imported before the meter starts: the import is not the work's

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
