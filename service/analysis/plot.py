"""Pictures of a store, for people who would rather look than read: ``classgrad plot``.

Holds ``PlotConfig`` (options, defaults), ``average_linkage`` (the clustered order of the
heatmap and its merge tree; ``average_linkage_order`` the order alone, ``dendrogram_segments`` the
tree's lines), ``param_rms`` (per-element gradient size of each parameter), ``class_similarity``
(the similarity of a few classes: read from the stored matrix when there is a finished one,
else computed from their rows, band by band), ``clustered_heatmap`` (those classes drawn in
clustered order), ``require_matplotlib``, the drawing helpers ``new_figure``, ``save_png`` and
``similarity_heatmap`` (``log_plot`` draws a training log's figures with them), and ``plot_store``
which writes three PNGs (matplotlib figures drawn by the Agg canvas directly, never through
pyplot, so no display is needed and the caller's backend is left alone; fixed pixel sizes
``figsize * dpi``):

- ``similarity_heatmap.png``: the top-N classes by gradient norm, in clustered order, with the
  dendrogram above; class names (or ids) as tick labels up to ``MAX_LABELS`` classes, else none
  and the count in the axis label; margins sized to the labels shown; one symmetric colour scale
  from the largest off-diagonal value (cosine too: a +-1 scale showed typical gradient cosines as
  white);
- ``class_norms.png``: a histogram of per-class gradient norms (log-spaced bins when they span
  more than two decades);
- ``param_norms.png``: each parameter's gradient size per element over all classes,
  |g_p| / sqrt(size_p) (so big tensors do not win by size alone), the largest ``MAX_BARS`` as
  horizontal bars with a "+N more" note, each with its share of the squared norm
  |g_p|^2 / sum |g_q|^2 at its end, the share ``classgrad inspect`` ranks by (the title says
  which ranking the bars follow); absent for projected stores, which have no parameters.

Text is at least ``TICK_FONT`` points and axes are placed in inches, so every figure reads at its
default size whatever the dpi.

Why average linkage: the heatmap should show groups of classes with similar gradients as
blocks on the diagonal. Agglomerative clustering with average linkage (UPGMA) on the distance
1 - cosine builds exactly such groups, is deterministic, and is what seaborn's clustermap and
scipy's dendrogram default to, so the picture matches what users know; scipy is not a
dependency, and for the N <= a few hundred classes a heatmap can show, the O(N^3) numpy
version takes milliseconds. Leaves are laid out in dendrogram order; at each merge the two
subtrees are flipped so that their most similar ends meet (a cheap form of optimal leaf
ordering). For ``dot`` the distance uses the cosine derived from the Gram matrix, so that large
rows do not dominate the grouping; the colours still show the dot products.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from classgrad.config.fields import MemoryMiB
from classgrad.errors import ConfigError, StoreIncompleteError
from classgrad.service.analysis import DEFAULT_BLOCK_MB, MIB, cosine_from_gram, validated
from classgrad.store import open_store

log = logging.getLogger(__name__)

HEATMAP_SIZE = (9.0, 8.0)  # inches; pixels = inches * dpi
HIST_SIZE = (8.0, 5.0)
BARS_SIZE = (9.0, 6.0)
MAX_BARS = 25  # parameters in the bar chart; the rest are counted in a "+N more" note
MAX_LABELS = 40  # tick labels on the heatmap up to this many classes (>= 8 pt each at 5.2 in)
FONT = 10  # points: axis labels, titles
TICK_FONT = 8  # points: tick labels, the smallest text in the figures
LABEL_CHARS = 24  # class names longer than this are cut (the margin holds about this many)
NAME_CHARS = 40  # parameter names longer than this keep their end


class PlotConfig(BaseModel):
    """Options of ``classgrad plot`` (defaults in one place)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN options: refused in one line

    top_n: int = Field(40, ge=2, le=500, description="classes in the heatmap: the ones with the largest gradient norms")
    metric: Literal["cosine", "dot"] | None = Field(
        None,
        description="similarity of the heatmap when computing it (default: the stored matrix's metric, else cosine)",
    )
    dpi: int = Field(100, ge=30, le=600, description="pixels per inch of the PNGs")
    block_rows: int | None = Field(None, ge=1, description="rows read at once for the norms")
    block_mb: MemoryMiB = Field(DEFAULT_BLOCK_MB, description="memory budget in MiB of one read")


def average_linkage(dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average-linkage (UPGMA) clustering of a symmetric distance matrix: (leaf order, merges).
    ``merges`` [n-1, 3] is the merge tree in scipy's convention: row k joins nodes ``merges[k, 0]``
    and ``merges[k, 1]`` (ids < n are leaves, id n + j is the cluster made by row j) at distance
    ``merges[k, 2]``. At each merge the subtrees are oriented so that their closest ends meet,
    so every cluster is a contiguous run of the order. Deterministic."""
    n = dist.shape[0]
    base = np.asarray(dist, dtype=np.float64)
    d = base.copy()
    np.fill_diagonal(d, np.inf)
    size = np.ones(n)
    members: dict[int, list[int]] = {i: [i] for i in range(n)}
    node = list(range(n))  # tree node id of the cluster held in each slot
    merges = np.zeros((max(n - 1, 0), 3))
    for k in range(n - 1):
        a, b = divmod(int(np.argmin(d)), n)
        a, b = min(a, b), max(a, b)
        merges[k] = (node[a], node[b], d[a, b])
        left, right = members.pop(a), members.pop(b)
        # The orientation whose junction (last of one, first of the other) is closest.
        options = [(left, right), (left, right[::-1]), (left[::-1], right), (left[::-1], right[::-1])]
        best = min(options, key=lambda o: base[o[0][-1], o[1][0]])
        members[a] = best[0] + best[1]
        node[a] = n + k
        merged = (size[a] * d[a] + size[b] * d[b]) / (size[a] + size[b])
        d[a], d[:, a] = merged, merged
        d[a, a] = np.inf
        d[b], d[:, b] = np.inf, np.inf
        size[a] += size[b]
    order = np.array(next(iter(members.values())) if members else [], dtype=np.int64)
    return order, merges


def average_linkage_order(dist: np.ndarray) -> np.ndarray:
    """Leaf order of ``average_linkage``."""
    return average_linkage(dist)[0]


def dendrogram_segments(order: np.ndarray, merges: np.ndarray) -> list[tuple[list[float], list[float]]]:
    """The lines of a dendrogram drawn over leaves at x = 0 .. n-1 in ``order``: one (xs, ys)
    U-shape per merge, from each child's (x, height) up to the merge height."""
    n = len(order)
    x = np.zeros(n + len(merges))
    x[order] = np.arange(n)
    height = np.zeros(n + len(merges))
    lines = []
    for k, (a, b, h) in enumerate(merges):
        a, b = int(a), int(b)
        lines.append(([x[a], x[a], x[b], x[b]], [height[a], h, h, height[b]]))
        x[n + k] = (x[a] + x[b]) / 2
        height[n + k] = h
    return lines


def class_similarity(
    store, rows: np.ndarray, metric: str | None = None, *, block_mb: float = DEFAULT_BLOCK_MB
) -> tuple[np.ndarray, str, str]:
    """Similarity [n, n] of ``rows``: (matrix, metric, "stored" or "computed"). The stored
    matrix is used when it is finished, dense and has the asked metric; otherwise the Gram matrix of
    these rows is computed from the store, one column band at a time."""
    info = store.similarity_info()
    if (
        info is not None
        and info.get("state") == "ready"
        and info.get("dense", True)  # a top-k-only result has no matrix to read
        and metric in (None, info["metric"])
        and info.get("source_fingerprint") == store.fingerprint
    ):
        return store.similarity(rows, rows), info["metric"], "stored"
    metric = metric or "cosine"
    n = len(rows)
    band = max(1, int(block_mb * MIB) // (4 * n))
    gram = np.zeros((n, n), dtype=np.float64)
    for c0 in range(0, store.dim, band):
        x = store.rows_band(rows, (c0, min(c0 + band, store.dim))).astype(np.float64)
        gram += x @ x.T
        del x
    sim = cosine_from_gram(gram) if metric == "cosine" else gram.astype(np.float32)
    return sim, metric, "computed"


def _short(text: str, limit: int, *, keep: str = "start") -> str:
    """``text`` cut to ``limit`` characters with an ellipsis (keeping its end for dotted
    parameter names, whose last parts say the most)."""
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "…" if keep == "start" else "…" + text[-(limit - 1) :]


def _labels(store, rows: np.ndarray) -> list[str]:
    names = store.class_names
    ids = store.class_ids
    return [_short(names[r], LABEL_CHARS) if names is not None else str(int(ids[r])) for r in rows]


def new_figure(size: tuple[float, float], dpi: int):
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=dpi)


def save_png(fig, path: Path, dpi: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi, format="png")  # no bbox_inches="tight": the size stays fixed


def _inches(fig, left: float, bottom: float, width: float, height: float):
    """Axes placed in inches, so that cells stay square and margins fit the labels at any dpi."""
    w, h = fig.get_size_inches()
    return fig.add_axes((left / w, bottom / h, width / w, height / h))


def similarity_heatmap(
    store,
    sim: np.ndarray,
    rows: np.ndarray,
    tree: tuple[np.ndarray, np.ndarray] | None,
    metric: str,
    source: str,
    path: Path,
    dpi: int,
) -> dict:
    """Draw the heatmap (and above it the dendrogram of ``tree`` = (leaf order, merges) when it is
    clustered; ``sim`` and ``rows`` are already in leaf order); return what was
    drawn: tick labels per axis, whether the dendrogram is there, the number of axes."""
    fig = new_figure(HEATMAP_SIZE, dpi)
    n = len(rows)
    labels = _labels(store, rows) if n <= MAX_LABELS else []
    # Margins in inches from what they hold: the longest tick label (about 0.07 in a character at
    # TICK_FONT) and the axis label; the square heatmap takes what is left, so no figure has a
    # margin reserved for labels it does not show.
    margin = 0.5 + 0.07 * max((len(label) for label in labels), default=0)
    left, bottom = margin, margin + 0.05
    above = (0.65 if tree is not None else 0.0) + 0.6  # the dendrogram and the two-line title
    side = min(HEATMAP_SIZE[1] - bottom - above - 0.05, HEATMAP_SIZE[0] - left - 1.6)
    left += (HEATMAP_SIZE[0] - left - 1.6 - side) / 2  # centred in the room beside the colour bar
    ax = _inches(fig, left, bottom, side, side)
    cax = _inches(fig, left + side + 0.3, bottom, 0.2, side)
    # One symmetric scale from the largest off-diagonal value, for cosine too: gradient cosines
    # between classes are often within +-0.2, which a +-1 scale shows as white; the diagonal
    # (each class with itself, 1 for cosine) is then drawn at the darkest colour.
    off = np.abs(sim[~np.eye(n, dtype=bool)])
    vmax = float(off.max()) if off.size and np.isfinite(off).all() and off.max() > 0 else 1.0
    image = ax.imshow(sim, cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest", aspect="auto")
    bar = fig.colorbar(image, cax=cax)
    what_value = "cosine similarity" if metric == "cosine" else "dot product of gradients"
    bar.set_label(f"{what_value} (scale: the largest between two classes)", fontsize=FONT)
    bar.ax.tick_params(labelsize=FONT)
    named = store.class_names is not None
    what = "class name" if named else "class id"
    if labels:
        ax.set_xticks(range(n), labels, rotation=90, fontsize=TICK_FONT)
        ax.set_yticks(range(n), labels, fontsize=TICK_FONT)
        ax.set_xlabel(what, fontsize=FONT)
        ax.set_ylabel(what, fontsize=FONT)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(f"{n} classes ({what}s not shown: too many to read)", fontsize=FONT)
        ax.set_ylabel(f"{n} classes", fontsize=FONT)
    ax.tick_params(length=2)
    drawn = {
        "tick_labels": len(ax.get_xticklabels()) if labels else 0,
        "dendrogram": tree is not None,
        "vmax": vmax,
        "side_in": side,
    }
    order = "average-linkage order, dendrogram above" if tree is not None else "stored order"
    top = bottom + side
    if tree is not None:
        dax = _inches(fig, left, top + 0.05, side, 0.6)
        for xs, ys in dendrogram_segments(*tree):
            dax.plot(xs, ys, color="0.25", linewidth=0.8)
        dax.set_xlim(-0.5, n - 0.5)
        dax.set_ylim(0, max(float(tree[1][:, 2].max()), 1e-12) * 1.05)
        dax.set_xticks([])
        dax.tick_params(labelsize=TICK_FONT, length=2)
        dax.set_ylabel("1 − cos", fontsize=TICK_FONT)
        for spine in ("top", "right", "bottom"):
            dax.spines[spine].set_visible(False)
        top += 0.65
    fig.text(
        (left + side / 2) / HEATMAP_SIZE[0],
        (top + 0.04) / HEATMAP_SIZE[1],
        f"{metric} similarity of the {n} classes with the largest gradient norms\n({order}; {source})",
        ha="center",
        va="bottom",
        fontsize=FONT,
    )
    drawn["axes"] = len(fig.axes)
    save_png(fig, path, dpi)
    return drawn


def _histogram(norms: np.ndarray, path: Path, dpi: int) -> None:
    fig = new_figure(HIST_SIZE, dpi)
    ax = fig.add_subplot()
    finite = norms[np.isfinite(norms)]
    positive = finite[finite > 0]
    zeros = int((finite == 0).sum())
    note = f"; {zeros} zero rows not shown" if zeros else ""
    if positive.size and positive.max() / positive.min() > 100:
        bins: np.ndarray | int = np.logspace(np.log10(positive.min()), np.log10(positive.max()), 50)
        ax.set_xscale("log")
    else:
        bins = 50
    if positive.size:
        ax.hist(positive, bins=bins, color="tab:blue")
    ax.set_xlabel("per-class gradient norm |dL_c/dθ|", fontsize=FONT)
    ax.set_ylabel("number of classes", fontsize=FONT)
    ax.yaxis.get_major_locator().set_params(integer=True)  # counts: no 2.5 classes
    ax.tick_params(labelsize=FONT)
    ax.set_title(f"per-class gradient norms ({finite.size} classes{note})", fontsize=FONT + 1)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.9, bottom=0.13)
    save_png(fig, path, dpi)


def param_rms(norms, sizes: np.ndarray) -> np.ndarray:
    """Per-element gradient size of each parameter over all classes: |g_p| / sqrt(size_p), the
    root mean square of the per-element norms sqrt(sum_c g_c,j^2), so that large tensors do not
    win by their size alone."""
    return norms.param_total / np.sqrt(np.asarray(sizes, dtype=np.float64))


def _bars(names: list[str], values: np.ndarray, shares: np.ndarray, path: Path, dpi: int) -> dict:
    """Horizontal bars of the largest ``MAX_BARS`` values, largest on top, each with its share of
    the squared norm (what ``classgrad inspect`` ranks by) at its end; return what was drawn."""
    fig = new_figure(BARS_SIZE, dpi)
    ax = fig.add_axes((2.7 / BARS_SIZE[0], 0.75 / BARS_SIZE[1], 5.9 / BARS_SIZE[0], 4.65 / BARS_SIZE[1]))
    order = np.argsort(-values, kind="stable")[:MAX_BARS]
    more = len(names) - len(order)
    shown = [names[i] for i in order]
    ax.barh(range(len(order)), values[order], color="tab:orange")
    for y, i in enumerate(order):
        share = f"{shares[i]:.1%}"
        ax.annotate(share, (values[i], y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=TICK_FONT)
    labels = [_short(m, NAME_CHARS, keep="end") for m in shown]
    if more:  # one more row without a bar, its label saying how many are left out
        labels.append(f"+{more} more (smaller)")
    ax.set_yticks(range(len(labels)), labels, fontsize=TICK_FONT)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # largest on top
    positive = values[order][values[order] > 0]
    if positive.size and positive.max() / positive.min() > 100:
        ax.set_xscale("log")
    ax.tick_params(axis="x", labelsize=FONT)
    ax.set_xlabel("RMS gradient per element over all classes, |g_p| / sqrt(size_p)", fontsize=FONT)
    ax.set_ylabel("parameter", fontsize=FONT)
    which = (
        f"the {len(order)} largest of {len(names)} parameters" if more else f"{len(names)} parameters, largest first"
    )
    ax.set_title(
        f"per-parameter gradient size, ranked by RMS per element ({which})\n"
        "at each bar: its share of the squared norm, what `classgrad inspect` ranks by",
        fontsize=FONT,
    )
    ax.margins(x=0.12)  # room for the share at the end of the longest bar
    save_png(fig, path, dpi)
    return {
        "names": shown,
        "rms": values[order].tolist(),
        "share": shares[order].tolist(),
        "ranking": "rms_per_element",
        "more": more,
    }


def require_matplotlib() -> None:
    """One line, before any work, when matplotlib (the ``plot`` extra) is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("classgrad plot needs matplotlib: pip install 'classgrad[plot]'") from None


def make_out_dir(out_dir: str) -> Path:
    """The plots' folder ``out_dir``, made (with its parents), or one line saying why not."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out_dir!r}: cannot create the directory: {exc}") from None
    return out


def clustered_heatmap(store, top: np.ndarray, config: PlotConfig, path: Path, note: str = "") -> dict:
    """The similarity of rows ``top`` of ``store`` (``class_similarity``) drawn in average-linkage
    order into ``path``; ``note``: added to the title's source. Returns the rows in drawn order,
    the metric, the similarity's source and what was drawn."""
    sim, metric, source = class_similarity(store, top, config.metric, block_mb=config.block_mb)
    cos = sim if metric == "cosine" else cosine_from_gram(sim.astype(np.float64))
    order, merges = average_linkage(np.clip(1.0 - cos.astype(np.float64), 0.0, None))
    rows = top[order]
    title = f"{source}; {note}" if note else source
    drawn = similarity_heatmap(store, sim[np.ix_(order, order)], rows, (order, merges), metric, title, path, config.dpi)
    return {"heatmap_rows": rows.tolist(), "metric": metric, "similarity_source": source, "heatmap": drawn}


def plot_store(url: str, out_dir: str, *, storage_options: dict | None = None, **options) -> dict:
    """Write the PNGs of the store at ``url`` into ``out_dir``; return what was written."""
    from classgrad.service.analysis.inspect import grad_norms

    config: PlotConfig = validated(PlotConfig, "plot", **options)
    require_matplotlib()
    store = open_store(url, storage_options=storage_options)
    norms = grad_norms(store, block_rows=config.block_rows, block_mb=config.block_mb)
    finite = np.isfinite(norms.row)
    if not finite.any():
        raise StoreIncompleteError(f"store {url} has no rows written yet; nothing to plot")
    out = make_out_dir(out_dir)  # made only once the store has been read: a failed plot leaves nothing behind
    written: dict[str, str] = {}
    top = np.sort(norms.top(config.top_n))
    result: dict = {"files": written, "top_rows": top.tolist()}
    if len(top) >= 2:
        path = out / "similarity_heatmap.png"
        result.update(clustered_heatmap(store, top, config, path))
        written["similarity_heatmap"] = str(path)
    path = out / "class_norms.png"
    _histogram(norms.row, path, config.dpi)
    written["class_norms"] = str(path)
    if norms.names:
        path = out / "param_norms.png"
        rms = param_rms(norms, np.array([e.size for e in store.layout]))
        squares = np.square(norms.param_total.astype(np.float64))
        shares = squares / squares.sum() if squares.sum() > 0 else np.zeros_like(squares)
        result["param_norms"] = _bars(norms.names, rms, shares, path, config.dpi)
        written["param_norms"] = str(path)
    else:
        result["note"] = "projected store: no per-parameter norms"
    result["sizes"] = {
        name: [int(round(w * config.dpi)), int(round(h * config.dpi))]
        for name, (w, h) in (
            ("similarity_heatmap", HEATMAP_SIZE),
            ("class_norms", HIST_SIZE),
            ("param_norms", BARS_SIZE),
        )
        if name in written
    }
    return result
