"""The plan of a top-k-only similarity run: tiles of the C x C product, sized to a task's memory.

Holds ``TopKPlan`` (query blocks, candidate parts, score windows, stream reads, column bands, the
table's chunk rows; the tasks, the memory bound of one task and how many times the store is read)
and ``plan_topk`` (those sizes from a per-task memory budget and the cluster's CPUs).

The product is tiled in two dimensions: a task takes one query block (rows [a, b)) and one
candidate part (rows [c0, c1)), and finds each query row's k best among the part. A query block
is as large as the budget allows, because each block streams its candidates once: the store is
read about ``len(blocks) + parts`` times in all (``passes``). Parallelism comes from the parts,
not from shrinking the query blocks: before, a cluster of W CPUs cut the store into W x
tasks_per_cpu query blocks, each of which read the whole store (62,500 reads of it at 1,000,000
classes on 1,000 CPUs). For T = tasks_per_cpu x workers tasks the plan takes
b = max(blocks the budget needs, round(sqrt(T))) query blocks and ceil(T / b) parts, which
minimises b + parts for b x parts >= T. With several parts, each task returns its partial
neighbours and the driver merges a block's parts (``merge_partials`` in ``similarity_topk``)
before writing them; with one part, the task writes its block itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from classgrad.errors import ConfigError
from classgrad.service.analysis import MIB, ceil_div, spans

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
    part_rows: int = 0  # candidate rows of one task (0: every row, one part)

    @property
    def window(self) -> int:
        return self.window_rows or self.num_classes

    def blocks(self) -> list[tuple[int, int]]:
        return spans(0, self.num_classes, self.block_rows)

    def parts(self) -> list[tuple[int, int]]:
        """The candidate rows of each task of a query block."""
        return spans(0, self.num_classes, self.part_rows or self.num_classes)

    def tasks(self) -> list[tuple[int, int, int, int]]:
        """(a, b, c0, c1) of every task, block by block: query rows [a, b), candidates [c0, c1)."""
        return [(a, b, c0, c1) for a, b in self.blocks() for c0, c1 in self.parts()]

    def windows(self, c0: int = 0, c1: int | None = None) -> list[tuple[int, int]]:
        """The score windows over candidates [c0, c1) (default: every row)."""
        return spans(c0, self.num_classes if c1 is None else c1, self.window)

    def stream_blocks(self) -> list[tuple[int, int]]:
        return [s for w0, w1 in self.windows() for s in spans(w0, w1, self.stream_rows)]

    def bands(self) -> list[tuple[int, int]]:
        return spans(0, self.dim, self.band_cols)

    def passes(self) -> int:
        """How many times the store's rows are read in all, rounded up: every query block
        streams every row once, and each task reads its query block once (full rows) or once
        per window (column bands)."""
        banded = self.band_cols < self.dim
        query = sum(len(self.windows(c0, c1)) if banded else 1 for c0, c1 in self.parts())
        return len(self.blocks()) + query

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
        window = min(self.window, self.part_rows or self.num_classes, self.num_classes)
        parts = {
            "query": B * (D if W >= D else W) * item,
            "stream": M * W * item,
            "read_in_flight": _READ_COPIES * min(self.read_rows or M, M) * (self.read_cols or W) * 4,
            "product": B * M * item if M < window else 0,
            # the window, and torch.topk's working copies of it (3 measured: a 608 x 600 merge took
            # +3.3 MiB beside its 1.4 MiB window)
            "scores": 4 * B * window * item + window * 16,
            "topk": B * _topk_row_bytes(self.top_k),
            "norm_scratch": 4 * (D if W >= D else W) * min(norm_rows(D if W >= D else W), max(B, M)),
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
    every row, unless half of what is left, the rest for windows of scores, gives a larger one
    (at 1,000,000 classes one window of every row leaves room for 16 query rows)."""
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
    whole = None  # one window of every row
    for stream in dict.fromkeys([max(shared, rc), *narrower]):
        rest = rest_beside(stream)
        per_query = query_cols * item + _topk_row_bytes(k) + stream * item  # + its product
        rows = min(cap, _round_down(max(rest - all_rows * 16, 0) // (per_query + 4 * all_rows * item), rc))
        if rows >= need and rows > 0:
            whole = rows, 0, stream, read_cols, min(read_rows, stream)
            break
    if whole is not None and whole[0] == cap:
        return whole
    windowed = []  # half of what is left for the query block, the rest for a window of scores
    wide = [m for m in (1024, 512, 256) if m < shared]
    for stream in dict.fromkeys([max(shared, rc), *wide, *narrower]):
        rest = rest_beside(stream)
        per_query = query_cols * item + _topk_row_bytes(k) + stream * item
        rows = min(cap, _round_down(max(rest, 0) // 2 // per_query, rc))
        window = _round_down(max(rest - rows * per_query, 0) // (4 * rows * item + 16), rc) if rows else 0
        if rows >= need and rows >= rc and window >= stream:
            windowed.append((rows, window, stream, read_cols, min(read_rows, stream)))
    if not windowed:
        return whole
    # The widest stream reads whose query block is at least half the largest: few stream rows
    # make products far slower (64 rows: 1.4x the time of 4,096 at 20,000 x 1,024 on the dev
    # machine), a smaller block costs only more reading.
    most = max(w[0] for w in windowed)
    best = next(w for w in windowed if 2 * w[0] >= most)
    return whole if whole is not None and whole[0] >= best[0] else best


def plan_topk(store, config: Any, workers: int = 1) -> TopKPlan:
    """Query blocks, candidate parts, score windows, stream reads and column bands for ``store``
    within ``config.task_mb`` MiB per task (``config`` is a ``SimilarityConfig``), with at least
    ``tasks_per_cpu`` tasks per worker when ``workers`` > 1. A query block is as large as the
    budget allows (full rows, unless column bands allow a larger block, or full rows do not fit
    at all), and no smaller than sqrt(tasks) blocks need; the rest of the parallelism comes from
    candidate parts (see the module's docstring). A given ``block_rows`` (a multiple of the
    store's row_chunk) or ``band_cols`` is used as given."""
    C, rc = store.num_classes, store.row_chunk
    all_rows = ceil_div(C, rc) * rc
    if config.block_rows is not None:
        if config.block_rows < 1 or config.block_rows % rc:
            raise ConfigError(
                f"--block-rows must be a positive multiple of the store's row_chunk ({rc}), got {config.block_rows}"
            )
        cap = min(config.block_rows, all_rows)
    else:
        cap = all_rows
    width, fit = _widest_fit(store, config, cap)
    tasks = config.tasks_per_cpu * workers if workers > 1 else 1
    blocks = ceil_div(C, fit[0])
    part_rows = 0
    if tasks > blocks:
        if config.block_rows is None and round(math.sqrt(tasks)) > blocks:
            # Smaller blocks, so that blocks + parts (the passes over the store) is least.
            cap = ceil_div(ceil_div(C, round(math.sqrt(tasks))), rc) * rc
            width, fit = _widest_fit(store, config, cap)
            blocks = ceil_div(C, fit[0])
        parts = min(ceil_div(tasks, blocks), ceil_div(C, rc))
        part_rows = ceil_div(ceil_div(C, parts), rc) * rc
        part_rows = 0 if part_rows >= C else part_rows
    rows, window, stream, read_cols, read_rows = fit
    k = min(config.top_k, C - 1)
    return TopKPlan(
        num_classes=C,
        dim=store.dim,
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
        part_rows=part_rows,
    )


def _widest_fit(store, config: Any, cap: int) -> tuple[int, tuple[int, int, int, int, int]]:
    """(band width, ``_fit``'s sizes) of a query block of at most ``cap`` rows (exactly ``cap``
    when ``config.block_rows`` is given): the widest bands that fit; with column chunks
    narrower than a row, the bands that give the fewest passes over the store, the widest of
    those. Refuses a budget that holds no query block, in one line."""
    C, D, rc, cc = store.num_classes, store.dim, store.row_chunk, store.col_chunk
    k = min(config.top_k, C - 1)
    item = 8 if config.precision == "float64" else 4
    avail = int(config.task_mb * MIB) - _SLACK_BYTES
    all_rows = ceil_div(C, rc) * rc
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
    if fixed:
        fits = [(w, f) for w, f in fits if f[0] == cap]
    if not fits:
        rows = cap if fixed else rc
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

    def passes(wf: tuple[int, tuple[int, ...]]) -> int:  # blocks, and the reads of a query block
        width, (rows, window, *_) = wf
        return ceil_div(C, rows) + (ceil_div(C, window) if width < D and window else 1)

    return fits[0] if cc >= D else min(fits, key=lambda wf: (passes(wf), -wf[0]))


def norm_rows(width: int) -> int:
    """Rows whose squares (float32) stay within ``_NORM_SCRATCH_BYTES``."""
    return max(1, _NORM_SCRATCH_BYTES // (4 * max(width, 1)))
