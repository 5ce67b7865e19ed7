"""``classgrad similarity LOG --window W``: the class similarity of one window of a training log.

Holds ``LOG_OPTIONS`` (the ``SimilarityConfig`` fields a log's similarity takes),
``WindowSimilarity`` (the result) and ``window_similarity``.

What is computed: the C x C cosine (or dot) similarity of the window's rows ``grads[w]`` (each
class's rows summed over the window's steps, as logged: sketched when the log is; cosine is the
same for the sums as for the class's mean row, a positive scale per row), with each class's
top-k neighbours (self excluded, ties to the lower class). A class with no samples in the window
has no row there (zeros): it has no neighbours (index -1, value NaN) and is no class's neighbour;
its row and column of the matrix are 0. It is the store's similarity code on
the log's rows: ``similarity.plan_similarity`` sizes the row blocks and column bands within
``block_mb``, ``compute_strip`` computes each block's strip of the matrix (float32 products,
float64 norms, symmetric bit for bit) and ``top_k_rows`` its neighbours; ``wants_dense`` chooses
whether the matrix is kept (at most 1 GiB, or ``dense``), else only the table. The strips run
one after another in this process (a log's window is one store's worth of rows, read from the
log as they are needed). The log is never written: the matrix is returned, or written to ``out``
(a ``.npy`` file, strip by strip through a memory map, so it is never whole in memory; renamed
into place once complete, removed if the run fails).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from classgrad.errors import ConfigError, StoreError
from classgrad.service.analysis import validated
from classgrad.service.analysis.log_rows import LogRows, pick_windows
from classgrad.service.analysis.similarity import (
    SimilarityConfig,
    compute_strip,
    plan_similarity,
    top_k_rows,
    wants_dense,
)
from classgrad.store.training_log.log_store import open_log_reader
from classgrad.workers.projection import neighbour_caveat

log = logging.getLogger(__name__)

# What applies to a log (the rest of SimilarityConfig is Ray's, or the top-k-only task's budget).
LOG_OPTIONS = ("metric", "top_k", "dense", "block_rows", "band_cols", "block_mb", "precision")


@dataclass
class WindowSimilarity:
    """One window's similarity: ``index``/``value`` ``[C, top_k]`` (best first, self excluded);
    ``matrix`` ``[C, C]`` float32 (read-only memory map of ``out`` when written there; None when
    only the table was computed); ``summary`` (what ran, as ``classgrad similarity`` reports it)."""

    window: int
    metric: str
    index: np.ndarray
    value: np.ndarray
    matrix: np.ndarray | None
    summary: dict


def _target(out: str) -> tuple[Path, Path]:
    path = Path(out)
    if path.suffix != ".npy":
        raise ConfigError(f"similarity option out (--out): {out!r} is not a .npy file (the matrix is written as one)")
    if not path.parent.is_dir():
        raise ConfigError(f"similarity option out (--out): the folder of {out!r} does not exist")
    return path, path.with_name(path.name + ".partial")


def window_similarity(
    url: str,
    window: int | str | None = None,
    *,
    out: str | None = None,
    storage_options: dict | None = None,
    **options: Any,
) -> WindowSimilarity:
    """The class similarity of window ``window`` (default: the last done one) of the log at
    ``url``. ``options``: ``LOG_OPTIONS`` fields of ``SimilarityConfig`` (``metric="dot"``,
    ``top_k=5``, ``dense=True``...). ``out``: a local ``.npy`` path for the matrix."""
    other = sorted(set(options) - set(LOG_OPTIONS))
    if other:
        raise ConfigError(
            f"similarity option {other[0]} does not apply to a training log (its similarity runs in this process)"
        )
    config: SimilarityConfig = validated(SimilarityConfig, "similarity", executor="local", **options)
    reader = open_log_reader(url, storage_options=storage_options)
    chosen = pick_windows(reader, "last" if window is None else window, option="--window")
    if len(chosen) != 1:
        raise ConfigError(f"--window {window!r}: one window at a time (got {len(chosen)})")
    w = chosen[0]
    rows = LogRows(reader, [w], "grads")
    C = rows.num_classes
    if C < 2:
        raise StoreError(f"grad log {url} has {C} class; similarity needs two")
    caveat = neighbour_caveat(reader.spec.projection)
    if caveat:
        log.warning("grad log %s: %s", url, caveat)
    dense = wants_dense(config, C)
    if out is not None and not dense:
        raise ConfigError(
            "similarity option out (--out): only the top-k table is computed here (--top-k-only, or a matrix "
            "above 1 GiB): give --dense to compute and write the matrix"
        )
    target = _target(out) if out is not None else None
    plan = plan_similarity(rows, config)
    t0 = time.perf_counter()
    matrix: np.ndarray | None = None
    if dense:
        matrix = (
            np.zeros((C, C), dtype=np.float32)
            if target is None
            else np.lib.format.open_memmap(target[1], mode="w+", dtype=np.float32, shape=(C, C))
        )
    empty = reader.read("count", w) == 0  # classes with no samples in the window: no row to compare
    index = np.empty((C, plan.top_k), dtype=np.int64)
    value = np.empty((C, plan.top_k), dtype=np.float32)
    read = 0
    try:
        for a, b in plan.blocks():
            strip, got = compute_strip(rows, plan, a, b)
            index[a:b], value[a:b] = top_k_rows(strip, a, plan.top_k, excluded=empty)
            if matrix is not None:
                matrix[a:b] = strip
            read += got
            del strip
    except BaseException:
        if target is not None:  # nothing half-written is left where the matrix would be
            del matrix
            target[1].unlink(missing_ok=True)
        raise
    if target is not None:
        assert isinstance(matrix, np.memmap)
        matrix.flush()
        del matrix
        os.replace(target[1], target[0])  # the matrix appears whole, or not at all
        matrix = np.load(target[0], mmap_mode="r")
    steps = reader.read("steps", w)
    summary = {
        "log": url,
        "window": w,
        "steps": [int(steps[0]), int(steps[1])],
        "metric": plan.metric,
        "dense": dense,
        "top_k": plan.top_k,
        "num_classes": C,
        "empty_classes": int(empty.sum()),
        "dim": plan.dim,
        "block_rows": plan.block_rows,
        "band_cols": plan.band_cols,
        "precision": plan.precision,
        "tasks": len(plan.blocks()),
        "seconds": time.perf_counter() - t0,
        "read_bytes": read,
        "memory_bound_bytes": plan.memory_bound()["total"],
        "out": None if target is None else str(target[0]),
    }
    return WindowSimilarity(window=w, metric=plan.metric, index=index, value=value, matrix=matrix, summary=summary)
