"""Row and column selections: checked row ids, merged row ranges and their one-line form.

Holds ``row_ids`` (any selection of rows -> int64 row indices, checked), ``row_ranges``
(sorted row ids -> merged [start, stop) ranges), ``fmt_ranges`` (those ranges for a message),
``col_range`` (a contiguous column range, checked) and ``rows_by_chunks`` (rows gathered from
whole row chunks, each read once: how the records of the training log and of the analysis
outputs check what they return). Numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from classgrad.errors import StoreError


def row_ids(ids: Any, num_rows: int) -> np.ndarray:
    """``ids`` (None = all, a slice, or integers) as int64 row indices in [0, num_rows)."""
    if ids is None:
        return np.arange(num_rows, dtype=np.int64)
    if isinstance(ids, slice):
        return np.arange(*ids.indices(num_rows), dtype=np.int64)
    arr = np.asarray(ids).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise StoreError(f"row ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_rows):
        raise StoreError(f"row ids must lie in [0, {num_rows}), got [{arr.min()}, {arr.max()}]")
    return arr


def row_ranges(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted row ids -> merged [start, stop) ranges."""
    if sorted_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [sorted_ids.size]))
    return [(int(sorted_ids[a]), int(sorted_ids[b - 1]) + 1) for a, b in zip(starts, stops)]


def fmt_ranges(ranges: list[tuple[int, int]], limit: int = 5) -> str:
    """``[a, b), [c, d)``: the first ``limit`` ranges, then "and N more"."""
    text = ", ".join(f"[{a}, {b})" for a, b in ranges[:limit])
    if len(ranges) > limit:
        text += f" and {len(ranges) - limit} more"
    return text


def col_range(cols: slice | tuple[int, int] | None, dim: int) -> slice:
    """A contiguous column range (a slice or a (start, stop) pair; None = all) within [0, dim)."""
    if cols is None:
        return slice(0, dim)
    if isinstance(cols, slice):
        if cols.step not in (None, 1):
            raise StoreError(f"column range must be contiguous, got step {cols.step}")
        start, stop, _ = cols.indices(dim)
    else:
        start, stop = (int(c) for c in cols)
    if not 0 <= start <= stop <= dim:
        raise StoreError(f"columns [{start}, {stop}) are outside [0, {dim})")
    return slice(start, stop)


def rows_by_chunks(
    ids: np.ndarray, chunk_rows: int, num_rows: int, read_chunk: Callable[[int, int, int], np.ndarray]
) -> np.ndarray:
    """Rows ``ids`` (a non-empty int64 array, any order) of an array of ``num_rows`` rows in
    chunks of ``chunk_rows``, each needed chunk read whole, once: ``read_chunk(j, start, stop)``
    returns rows [start, stop) of chunk ``j`` (checked as its caller wants).

    1-D ids, consecutive and covering the chunks read (a whole window), come back as those
    chunks, not gathered again (at C = 10,000 x 4,096 a copy of the rows is 156 MiB): one chunk
    is then ``read_chunk``'s own array, as writable as it made it."""
    needed = np.unique(ids // chunk_rows)
    pieces = [read_chunk(j, j * chunk_rows, min((j + 1) * chunk_rows, num_rows)) for j in needed.tolist()]
    # The needed chunks in order (each whole but the array's last): one chunk as it was read.
    held = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    at = np.searchsorted(needed, ids // chunk_rows) * chunk_rows + ids % chunk_rows
    if at.ndim == 1 and at[-1] - at[0] == at.size - 1 and bool((np.diff(at) == 1).all()):
        # All of them: the chunks as read. A part is copied: its view would keep the whole chunks.
        return held if at.size == held.shape[0] else held[at[0] : at[-1] + 1].copy()
    return held[at]
