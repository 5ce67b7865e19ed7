"""Pictures of a training log (``GradLog``): ``classgrad plot LOG``.

Holds ``window_norms`` (each done window's row norms) and ``plot_log``, which writes, with
``plot``'s options (``PlotConfig``) and its drawing helpers (Agg canvas, fixed pixel sizes):

- ``log_norms.png``: a class x window heatmap of the norm of each class's row summed over the
  window's steps, |grads[w, c]| (sums, not means: a class seen in more steps of a window has a
  larger sum; the log does not record in how many steps each class was seen). Sketched logs give
  the norms of the sketched sums, which the sketch keeps in expectation. The top-N
  classes by the sum over windows of their norms, largest on top; a log colour scale when the
  norms span more than two decades (zeros, classes absent from a window, then drawn grey);
- ``log_norm_lines.png``: the norms of the ``LINE_CLASSES`` largest of those classes over
  training, one line each, against each window's first step;
- ``log_similarity_w{W}.png`` for each chosen window (default: the last done one): the class
  similarity heatmap of ``plot`` (``clustered_heatmap``: the top-N classes of that window by
  norm, cosine or dot computed from the window's rows, average-linkage order, dendrogram above).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from classgrad.service.analysis import validated
from classgrad.service.analysis.log_rows import LogRows, pick_windows
from classgrad.service.analysis.plot import (
    FONT,
    HEATMAP_SIZE,
    MAX_LABELS,
    TICK_FONT,
    PlotConfig,
    clustered_heatmap,
    make_out_dir,
    new_figure,
    require_matplotlib,
    save_png,
)
from classgrad.store.training_log.log_store import LogReader, missing_windows, open_log_reader

log = logging.getLogger(__name__)

NORMS_SIZE = (9.0, 6.0)  # inches; pixels = inches * dpi
LINES_SIZE = (9.0, 5.0)
LINE_CLASSES = 8  # lines in log_norm_lines.png: more do not read apart
MAX_WINDOW_TICKS = 20  # window labels on the heatmap's x axis, evenly spread


def window_norms(reader: LogReader, windows: Sequence[int]) -> np.ndarray:
    """|grads[w, c]| of each window of ``windows`` (float64 ``[len(windows), C]``)."""
    return np.stack([LogRows(reader, [w], "grads").norms() for w in windows])


def _wide_span(values: np.ndarray) -> bool:
    positive = values[values > 0]
    return bool(positive.size) and float(positive.max() / positive.min()) > 100


def _norm_heatmap(norms: np.ndarray, classes: np.ndarray, windows: list[int], path: Path, dpi: int) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    fig = new_figure(NORMS_SIZE, dpi)
    ax = fig.add_axes((0.1, 0.12, 0.72, 0.78))
    cax = fig.add_axes((0.85, 0.12, 0.025, 0.78))
    values = norms[:, classes].T  # [classes, windows]
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    if _wide_span(values):
        shown = np.ma.masked_less_equal(values, 0)
        image = ax.imshow(shown, cmap=cmap, norm=LogNorm(), aspect="auto", interpolation="nearest")
    else:
        image = ax.imshow(values, cmap=cmap, aspect="auto", interpolation="nearest")
    bar = fig.colorbar(image, cax=cax)
    bar.set_label("|grads[w, c]|: norm of the class's row summed over the window", fontsize=FONT)
    bar.ax.tick_params(labelsize=TICK_FONT)
    ticks = np.unique(np.linspace(0, len(windows) - 1, min(len(windows), MAX_WINDOW_TICKS)).round().astype(int))
    ax.set_xticks(ticks, [str(windows[i]) for i in ticks], fontsize=TICK_FONT)
    ax.set_xlabel("window", fontsize=FONT)
    if len(classes) <= MAX_LABELS:
        ax.set_yticks(range(len(classes)), [str(int(c)) for c in classes], fontsize=TICK_FONT)
        ax.set_ylabel("class id", fontsize=FONT)
    else:
        ax.set_yticks([])
        ax.set_ylabel(f"{len(classes)} classes (ids not shown: too many to read)", fontsize=FONT)
    ax.set_title(
        f"gradient norm per window of the {len(classes)} classes with the largest sum over windows",
        fontsize=FONT + 1,
    )
    save_png(fig, path, dpi)


def _norm_lines(norms: np.ndarray, classes: np.ndarray, starts: np.ndarray, path: Path, dpi: int) -> None:
    fig = new_figure(LINES_SIZE, dpi)
    ax = fig.add_axes((0.1, 0.13, 0.7, 0.77))
    for c in classes:
        ax.plot(starts, norms[:, c], marker="o", markersize=3, linewidth=1.2, label=f"class {int(c)}")
    if _wide_span(norms[:, classes]):
        ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps: no step 2.5
    ax.set_xlabel("training step (each window's first)", fontsize=FONT)
    ax.set_ylabel("|grads[w, c]|", fontsize=FONT)
    ax.tick_params(labelsize=TICK_FONT)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=TICK_FONT, frameon=False)
    ax.set_title(f"gradient norms over training, the {len(classes)} largest classes", fontsize=FONT + 1)
    save_png(fig, path, dpi)


def plot_log(
    url: str,
    out_dir: str,
    *,
    windows: str | int | Sequence[int] | None = None,
    storage_options: dict | None = None,
    **options,
) -> dict:
    """Write the PNGs of the training log at ``url`` into ``out_dir``; return what was written.
    ``windows``: those whose class similarity is drawn (``pick_windows``; default the last done
    one; the norms span every done window, or the windows asked for when a window is missing);
    ``options``: ``PlotConfig`` fields (``top_n``, ``metric``, ``dpi``, ``block_mb``)."""
    config: PlotConfig = validated(PlotConfig, "plot", **options)
    require_matplotlib()
    reader = open_log_reader(url, storage_options=storage_options)
    chosen = pick_windows(reader, "last" if windows is None else windows)
    if windows is not None and missing_windows(reader.done):  # the windows asked for, not across a hole
        done = [w for w in reader.done if min(chosen) <= w <= max(chosen)]
    else:
        done = pick_windows(reader, "all")  # refused when a window below the last is missing
    norms = window_norms(reader, done)
    total = norms.sum(axis=0)
    top = np.argsort(-total, kind="stable")[: config.top_n]
    out = make_out_dir(out_dir)  # made only once the log has been read: a failed plot leaves nothing behind
    written: dict[str, str] = {}
    sizes: dict[str, list[int]] = {}
    result: dict = {"files": written, "sizes": sizes, "windows": done, "top_rows": top.tolist(), "similarity": {}}

    def wrote(name: str, path: Path, size: tuple[float, float]) -> None:
        written[name] = str(path)
        sizes[name] = [int(round(size[0] * config.dpi)), int(round(size[1] * config.dpi))]

    path = out / "log_norms.png"
    _norm_heatmap(norms, top, done, path, config.dpi)
    wrote("log_norms", path, NORMS_SIZE)
    starts = np.array([int(reader.read("steps", w)[0]) for w in done])
    path = out / "log_norm_lines.png"
    _norm_lines(norms, top[:LINE_CLASSES], starts, path, config.dpi)
    wrote("log_norm_lines", path, LINES_SIZE)
    for w in chosen:
        here = norms[done.index(w)]
        ranked = np.argsort(-here, kind="stable")[: config.top_n]
        ranked = np.sort(ranked[here[ranked] > 0])  # classes absent from the window have no direction
        if len(ranked) < 2:
            log.warning("grad log %s: window %d has fewer than 2 classes with rows; no similarity drawn", url, w)
            continue
        steps = reader.read("steps", w)
        name = f"log_similarity_w{w}"
        path = out / f"{name}.png"
        note = f"window {w}, steps {int(steps[0])}-{int(steps[1]) - 1}"
        result["similarity"][w] = clustered_heatmap(LogRows(reader, [w], "grads"), ranked, config, path, note)
        wrote(name, path, HEATMAP_SIZE)
    return result
