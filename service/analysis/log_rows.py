"""A training log's rows as the store analyses read rows: what ``classgrad score``, ``similarity``
and ``plot`` share when they are given a log (``classgrad.store.training_log.log_store``) instead of a job's
store.

Holds ``pick_windows`` (the windows a command names: ``all`` (refused when windows below the
last done one are missing), ``last``, or indices and ranges such as ``0-3,7``; each checked
done by the log's reader, one line otherwise), ``fmt_windows``
(such a list written back as ranges) and ``LogRows`` (a
log's ``grads`` or ``lr_grads`` of some windows, summed, behind the reader interface the store
analyses take: ``num_classes``, ``dim``, ``row_chunk``, ``col_chunk``, ``block``, ``rows_band``,
``similarity_info``, ``class_ids``, ``class_names``), so ``similarity.compute_strip``,
``scoring.score_block`` and ``plot.class_similarity`` run on a log unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from classgrad.errors import ConfigError, StoreIncompleteError
from classgrad.store.core.indexing import col_range
from classgrad.store.training_log.log_store import LogReader, missing_windows

WINDOW_WORDS = ("all", "last")


def _parse(text: str, option: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            a = int(first)
            b = int(last) if dash else a
        except ValueError:
            raise ConfigError(
                f"{option} {text!r}: expected all, last, or window indices and ranges such as 0-3,7"
            ) from None
        if b < a:
            raise ConfigError(f"{option} {text!r}: the range {part.strip()} ends before it starts")
        out.extend(range(a, b + 1))
    return out


def pick_windows(
    reader: LogReader, windows: str | int | Sequence[int] | None, *, option: str = "--windows"
) -> list[int]:
    """The windows asked for, sorted: ``None`` or ``"all"`` every done window, ``"last"`` the
    last one, else indices (text ``0-3,7``); a window out of range or not done: one line."""
    if not reader.done:
        raise StoreIncompleteError(f"grad log {reader.url} has no done window yet: nothing to read")
    if windows is None or windows == "all":
        holes = missing_windows(reader.done)
        if holes:  # "all" would quietly leave them out (top-1 changed for 20% of queries)
            raise StoreIncompleteError(
                f"grad log {reader.url} lacks window(s) {fmt_windows(holes)} among its done windows "
                f"{fmt_windows(reader.done)}: {option} all would leave them out; name the windows to read "
                f"(e.g. {option} {fmt_windows([w for w in reader.done if w > holes[-1]]) or 'last'}), or relog them"
            )
        return list(reader.done)
    if windows == "last":
        return [reader.done[-1]]
    if isinstance(windows, str):
        chosen = _parse(windows, option)
    elif isinstance(windows, int):
        chosen = [windows]
    else:
        chosen = [int(w) for w in windows]
    if not chosen:
        raise ConfigError(f"{option}: no window given")
    for w in chosen:
        reader.check_window(w)
    return sorted(set(chosen))


def fmt_windows(windows: Sequence[int]) -> str:
    """``0-3, 7``: sorted windows as ranges."""
    runs: list[list[int]] = []
    for w in sorted(windows):
        if runs and w == runs[-1][1] + 1:
            runs[-1][1] = w
        else:
            runs.append([w, w])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class LogRows:
    """``array`` (``grads``: the windows' summed rows; ``lr_grads``: their learning-rate-weighted
    sums) of ``windows`` added up, read like a store's rows: true float32 values in blocks of
    rows and columns (the windows summed in float64 first, so the order of windows is no
    rounding). Class ids are the rows' indices; a log has no class names."""

    def __init__(self, reader: LogReader, windows: Sequence[int], array: str = "grads"):
        for w in windows:
            reader.check_window(w)
        self.reader = reader
        self.windows = list(windows)
        self.array = array
        self.url = reader.url
        self.num_classes = reader.spec.num_classes
        self.dim = reader.spec.width
        self.row_chunk = reader.row_chunk
        self.col_chunk = reader.spec.width  # a window's chunk holds whole rows
        self.class_ids = np.arange(self.num_classes, dtype=np.int64)
        self.class_names: list[str] | None = None

    def block(self, a: int, b: int, cols: slice | tuple[int, int] | None = None) -> np.ndarray:
        """Rows ``[a, b)``, columns ``cols`` (default all), float32."""
        span = col_range(cols, self.dim)
        total = np.zeros((b - a, span.stop - span.start), dtype=np.float64)
        for w in self.windows:
            total += self.reader.read(self.array, w, slice(a, b), span)
        return total.astype(np.float32)

    def rows_band(self, rows: Sequence[int] | np.ndarray, cols: slice | tuple[int, int] | None = None) -> np.ndarray:
        """The rows ``rows`` (any order), columns ``cols``, float32."""
        ids = np.asarray(rows, dtype=np.int64)
        span = col_range(cols, self.dim)
        total = np.zeros((len(ids), span.stop - span.start), dtype=np.float64)
        for w in self.windows:
            total += self.reader.read(self.array, w, ids, span)
        return total.astype(np.float32)

    def norms(self) -> np.ndarray:
        """Each row's Euclidean norm (float64 [C]), a row chunk at a time."""
        out = np.zeros(self.num_classes, dtype=np.float64)
        for a in range(0, self.num_classes, self.row_chunk):
            b = min(a + self.row_chunk, self.num_classes)
            out[a:b] = np.linalg.norm(self.block(a, b).astype(np.float64), axis=1)
        return out

    def similarity_info(self) -> None:
        """A log stores no similarity matrix: ``plot.class_similarity`` computes it from the rows."""
        return None
