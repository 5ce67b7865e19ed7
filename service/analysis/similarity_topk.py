"""Top-k class similarity without the C x C matrix: each class's k most similar classes (cosine
or dot), streamed block by block, for stores whose dense matrix would be too large to keep.

Holds ``merge_topk`` (one block of scores merged into the running top-k: the unit the unit tests
check), ``merge_partials`` (a query block's partial neighbours from several candidate parts
merged into its k best), ``streamed_topk`` (one query block's top-k among candidate rows, from
any row reader) and ``topk_task`` (the unit of work Ray or this process runs: read, compute, then
write the block's neighbours, or return them when its candidates are one part of several). The
tiles and their sizes are ``topk_plan``'s.

How it works. Task (i, j) owns query block Q (block_rows rows) and computes its scores against
the rows of candidate part j, one window of window_rows rows at a time: scores = Q S^T
(block_rows x window_rows), summed over column bands when rows are read in bands; then
``merge_topk`` keeps each query row's k best of (its running k best, the window's candidates).
The window's rows are read in stream blocks of stream_rows rows x one band, each into one reused
buffer, a few row chunks per read (read_rows: one read in flight decodes about 4 MiB, however
large the block); Q is read once (full rows) or once per window and band (banded), in reads of
the same size. So a task holds Q or one band of it, one stream buffer, one read in flight
(zarr's decoded chunks and the values as returned), one window of scores and k neighbours per
query row, whatever C is; the store is read ``TopKPlan.passes`` times in all. A window of scores
costs block_rows x window_rows while a band of Q costs block_rows x band_cols: for wide rows
(many parameters, few classes) bands let the query block be far larger than full rows would,
and the number of passes far smaller. Self is excluded (its score set to -inf); equal scores go
to the lower row index, as in the dense path, so the table is deterministic, however the
candidates are split into parts. For cosine the scores are scaled by 1 / (|q| |s|) (norms
summed in float64; rows of norm 0 score 0). Products are float32 (``precision="float64"``
computes in float64); values are stored float32.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from classgrad.service.analysis import spans
from classgrad.service.analysis.memory import PeakMemory
from classgrad.service.analysis.topk_plan import TopKPlan, norm_rows
from classgrad.store import open_store

Reader = Callable[[int, int, tuple[int, int]], np.ndarray]

# --------------------------------------------------------------------------- the merge


def merge_topk(best_val, best_idx, scores, col0: int, row0: int, k: int):
    """Merge one block of scores into the running top-k of its query rows.

    ``best_val`` / ``best_idx`` [B, k] (torch; best first, equal values by lower index; start
    with -inf / ``C``), ``scores`` [B, M] (torch; modified: the diagonal of rows that are also
    columns is set to -inf) for query rows row0.. and columns col0..; returns the new
    (values, indices), best first, equal values by lower index: the rows that change are
    updated in place. The block's own candidates are its k best with ties at the k-th value
    resolved to the lower index, so no entry dropped here could have been among the k best
    overall. Only rows whose block maximum reaches their running k-th value are merged: after
    the first blocks, few are (about k / w of them at the w-th block of a random order), which
    makes the merge a small part of a window's cost however narrow the windows."""
    import torch

    B, M = scores.shape
    lo, hi = max(row0, col0), min(row0 + B, col0 + M)
    if lo < hi:  # self is never its own neighbour
        r = torch.arange(lo, hi)
        scores[r - row0, r - col0] = float("-inf")
    reach = scores.amax(dim=1).to(best_val.dtype) >= best_val[:, -1]  # >=: a tie at a lower index enters
    rows = None if bool(reach.all()) else torch.nonzero(reach).flatten()
    if rows is not None:
        if len(rows) == 0:
            return best_val, best_idx
        scores = scores.index_select(0, rows)
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
    if rows is None:
        return _k_best(
            torch.cat([best_val, val.to(best_val.dtype)], dim=1), torch.cat([best_idx, pos + col0], dim=1), k
        )
    new_val, new_idx = _k_best(
        torch.cat([best_val[rows], val.to(best_val.dtype)], dim=1), torch.cat([best_idx[rows], pos + col0], dim=1), k
    )
    best_val[rows], best_idx[rows] = new_val, new_idx
    return best_val, best_idx


def _k_best(values, index, k: int):
    """Each row's k best of candidates (values, index) whose k best are among them: best first,
    equal values by lower index."""
    import torch

    by_index = torch.argsort(index, dim=1, stable=True)
    values, index = values.gather(1, by_index), index.gather(1, by_index)
    by_value = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
    return values.gather(1, by_value), index.gather(1, by_value)


def merge_partials(partials: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """A query block's neighbours from the partial neighbours of its candidate parts
    ((index int64 [n, k], value float32 [n, k]) each, as ``streamed_topk`` returns them): each
    row's k best of all, best first, equal values by lower index, the same table as one part
    gives (with float64 products, values that round to the same float32 go to the lower index).
    A part with fewer than k candidates pads with index C and value -inf, which sort last."""
    import torch

    index = torch.from_numpy(np.concatenate([i for i, _ in partials], axis=1))
    values = torch.from_numpy(np.concatenate([v for _, v in partials], axis=1))
    best_val, best_idx = _k_best(values, index, k)
    return best_idx.numpy(), best_val.numpy()


class PartMerger:
    """The driver's side of a plan with several candidate parts: each task's partial neighbours
    kept by query block until the block's last part arrives, then merged (``merge_partials``).
    Holds at most the blocks whose parts are in flight."""

    def __init__(self, plan: TopKPlan):
        self.parts = len(plan.parts())
        self.k = plan.top_k
        self._pending: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, report: dict) -> tuple[int, np.ndarray, np.ndarray] | None:
        """Take a task's report (its partial neighbours are removed from it); returns
        (start, index, value) of the block once every part of it has come, else None."""
        start = int(report["start"])
        got = self._pending.setdefault(start, [])
        got.append((report.pop("index"), report.pop("value")))
        report.pop("candidates", None)
        if len(got) < self.parts:
            return None
        del self._pending[start]
        index, value = merge_partials(got, self.k)
        return start, index, value


def _squared_norms(x) -> Any:
    """|row|^2, squares summed in float64, a few rows at a time: their float32 squares never
    exceed ``_NORM_SCRATCH_BYTES`` (plus one row), however wide the rows are (float64 copies
    of 256 rows at a time took 600 MiB outside the bound on 155,912 columns)."""
    import torch

    sq = torch.empty(x.shape[0], dtype=torch.float64)
    step = norm_rows(x.shape[1])
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


def streamed_topk(
    read: Reader, plan: TopKPlan, start: int, stop: int, candidates: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """The top-k neighbours of rows [start, stop) among the rows ``candidates`` (default: every
    row): (row indices int64 [n, k], values float32 [n, k], bytes of float32 values read).
    ``read(a, b, (c0, c1))`` returns rows [a, b) x columns [c0, c1) as float32 numpy (the
    store's ``block``)."""
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
    windows = plan.windows(*(candidates or (0, C)))
    scores_buffer = torch.empty(n * max(w1 - w0 for w0, w1 in windows), dtype=dtype)
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


def topk_task(
    url: str,
    storage_options: dict | None,
    plan: dict,
    start: int,
    stop: int,
    run_id: str,
    candidates: tuple[int, int] | None = None,
) -> dict:
    """One task: the top-k neighbours of rows [start, stop) among ``candidates`` (default: every
    row). Among every row, they are written into the store; among one part of the rows, they
    are returned in the report (``index``, ``value``) for the driver to merge. The report also
    has rows, seconds, bytes read and memory, like the dense task's."""
    import torch  # noqa: F401 - imported before the meter starts: the import is not the work's

    meter = PeakMemory()
    t0, cpu0 = time.perf_counter(), time.process_time()
    partial: dict[str, Any] = {}
    try:
        p = TopKPlan(**plan)
        store = open_store(url, storage_options=storage_options, mode="r+")
        index, value, read = streamed_topk(store.block, p, start, stop, candidates)
        if candidates is None or tuple(candidates) == (0, p.num_classes):
            store.similarity_arrays.write_neighbours(start, index, value, run_id=run_id)
        else:
            partial = {"candidates": tuple(candidates), "index": index, "value": value}
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
        **partial,
    }
