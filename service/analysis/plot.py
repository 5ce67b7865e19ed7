"""Pictures of a store, for people who would rather look than read: ``classgrad plot``.

Holds ``PlotConfig`` (options, defaults), ``average_linkage_order`` (the clustered order of the
heatmap), ``class_similarity`` (the similarity of a few classes: read from the stored matrix
when there is a finished one, else computed from their rows, band by band), and ``plot_store``
which writes three PNGs (matplotlib figures drawn by the Agg canvas directly, never through
pyplot, so no display is needed and the caller's backend is left alone; fixed pixel sizes
``figsize * dpi``):

- ``similarity_heatmap.png``: the top-N classes by gradient norm, in clustered order;
- ``class_norms.png``: a histogram of per-class gradient norms (log-spaced bins when they span
  more than two decades);
- ``param_norms.png``: each parameter's gradient norm over all classes (the largest 30), absent
  for projected stores, which have no parameters.

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

from classgrad.service.analysis import DEFAULT_BLOCK_MB, MIB, cosine_from_gram, validated

log = logging.getLogger(__name__)

HEATMAP_SIZE = (9.0, 8.0)  # inches; pixels = inches * dpi
HIST_SIZE = (8.0, 5.0)
BARS_SIZE = (9.0, 6.0)
MAX_BARS = 30
MAX_LABELS = 60  # tick labels on the heatmap up to this many classes


class PlotConfig(BaseModel):
    """Options of ``classgrad plot`` (defaults in one place)."""

    model_config = ConfigDict(extra="forbid")

    top_n: int = Field(40, ge=2, le=500, description="classes in the heatmap: the ones with the largest gradient norms")
    metric: Literal["cosine", "dot"] | None = Field(
        None,
        description="similarity of the heatmap when computing it (default: the stored matrix's metric, else cosine)",
    )
    dpi: int = Field(100, ge=30, le=600, description="pixels per inch of the PNGs")
    block_rows: int | None = Field(None, ge=1, description="rows read at once for the norms")
    block_mb: float = Field(DEFAULT_BLOCK_MB, gt=0, description="memory budget in MiB of one read")


def average_linkage_order(dist: np.ndarray) -> np.ndarray:
    """Leaf order of average-linkage (UPGMA) clustering of a symmetric distance matrix; at each
    merge the subtrees are oriented so that their closest ends meet. Deterministic."""
    n = dist.shape[0]
    if n <= 2:
        return np.arange(n)
    base = np.asarray(dist, dtype=np.float64)
    d = base.copy()
    np.fill_diagonal(d, np.inf)
    size = np.ones(n)
    members: dict[int, list[int]] = {i: [i] for i in range(n)}
    for _ in range(n - 1):
        a, b = divmod(int(np.argmin(d)), n)
        a, b = min(a, b), max(a, b)
        left, right = members.pop(a), members.pop(b)
        # The orientation whose junction (last of one, first of the other) is closest.
        options = [(left, right), (left, right[::-1]), (left[::-1], right), (left[::-1], right[::-1])]
        best = min(options, key=lambda o: base[o[0][-1], o[1][0]])
        members[a] = best[0] + best[1]
        merged = (size[a] * d[a] + size[b] * d[b]) / (size[a] + size[b])
        d[a], d[:, a] = merged, merged
        d[a, a] = np.inf
        d[b], d[:, b] = np.inf, np.inf
        size[a] += size[b]
    (order,) = members.values()
    return np.array(order, dtype=np.int64)


def class_similarity(
    store, rows: np.ndarray, metric: str | None = None, *, block_mb: float = DEFAULT_BLOCK_MB
) -> tuple[np.ndarray, str, str]:
    """Similarity [n, n] of ``rows``: (matrix, metric, "stored" or "computed"). The stored
    matrix is used when it is finished and has the asked metric; otherwise the Gram matrix of
    these rows is computed from the store, one column band at a time."""
    info = store.similarity_info()
    if (
        info is not None
        and info.get("state") == "ready"
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


def _labels(store, rows: np.ndarray) -> list[str]:
    names = store.class_names
    ids = store.class_ids
    return [names[r] if names is not None else str(int(ids[r])) for r in rows]


def _figure(size: tuple[float, float], dpi: int):
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=dpi)


def _save(fig, path: Path, dpi: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi, format="png")  # no bbox_inches="tight": the size stays fixed


def _heatmap(store, sim: np.ndarray, rows: np.ndarray, metric: str, source: str, path: Path, dpi: int) -> None:
    fig = _figure(HEATMAP_SIZE, dpi)
    ax = fig.add_axes((0.12, 0.1, 0.72, 0.8))
    cax = fig.add_axes((0.87, 0.1, 0.03, 0.8))
    if metric == "cosine":
        vmax = 1.0
    else:
        off = sim[~np.eye(len(sim), dtype=bool)]
        vmax = float(np.abs(off).max()) if off.size and np.abs(off).max() > 0 else 1.0
    image = ax.imshow(sim, cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
    fig.colorbar(image, cax=cax, label=f"{metric} similarity")
    n = len(rows)
    if n <= MAX_LABELS:
        labels = _labels(store, rows)
        size = 7 if n <= 30 else 5
        ax.set_xticks(range(n), labels, rotation=90, fontsize=size)
        ax.set_yticks(range(n), labels, fontsize=size)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title(
        f"{metric} similarity of the {n} classes with the largest gradient norms\n(average-linkage order; {source})",
        fontsize=10,
    )
    _save(fig, path, dpi)


def _histogram(norms: np.ndarray, path: Path, dpi: int) -> None:
    fig = _figure(HIST_SIZE, dpi)
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
    ax.set_xlabel("per-class gradient norm |dL_c/dθ|")
    ax.set_ylabel("classes")
    ax.set_title(f"per-class gradient norms ({finite.size} classes{note})", fontsize=10)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.9, bottom=0.12)
    _save(fig, path, dpi)


def _bars(names: list[str], totals: np.ndarray, path: Path, dpi: int) -> None:
    fig = _figure(BARS_SIZE, dpi)
    ax = fig.add_subplot()
    order = np.argsort(-totals, kind="stable")[:MAX_BARS]
    shown = [names[i] for i in order][::-1]
    ax.barh(range(len(order)), totals[order][::-1], color="tab:orange")
    ax.set_yticks(range(len(order)), shown, fontsize=7 if len(order) <= 20 else 5)
    ax.set_xlabel("gradient norm over all classes, sqrt(sum_c |dL_c/dθ_p|^2)")
    more = f", the largest {MAX_BARS} of {len(names)}" if len(names) > MAX_BARS else ""
    ax.set_title(f"per-parameter gradient norms{more}", fontsize=10)
    fig.subplots_adjust(left=0.3, right=0.97, top=0.92, bottom=0.1)
    _save(fig, path, dpi)


def plot_store(url: str, out_dir: str, *, storage_options: dict | None = None, **options) -> dict:
    """Write the PNGs of the store at ``url`` into ``out_dir``; return what was written."""
    from classgrad.service.analysis.inspect import grad_norms
    from classgrad.service.errors import ConfigError
    from classgrad.service.store import open_store

    config: PlotConfig = validated(PlotConfig, "plot", **options)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("classgrad plot needs matplotlib: pip install 'classgrad[plot]'") from None
    store = open_store(url, storage_options=storage_options)
    norms = grad_norms(store, block_rows=config.block_rows, block_mb=config.block_mb)
    finite = np.isfinite(norms.row)
    if not finite.any():
        from classgrad.service.errors import StoreIncompleteError

        raise StoreIncompleteError(f"store {url} has no rows written yet; nothing to plot")
    out = Path(out_dir)  # made only once the store has been read: a failed plot leaves nothing behind
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out_dir!r}: cannot create the directory: {exc}") from None
    written: dict[str, str] = {}
    top = np.sort(norms.top(config.top_n))
    result: dict = {"files": written, "top_rows": top.tolist()}
    if len(top) >= 2:
        sim, metric, source = class_similarity(store, top, config.metric, block_mb=config.block_mb)
        cos = sim if metric == "cosine" else cosine_from_gram(sim.astype(np.float64))
        order = average_linkage_order(np.clip(1.0 - cos.astype(np.float64), 0.0, None))
        rows = top[order]
        path = out / "similarity_heatmap.png"
        _heatmap(store, sim[np.ix_(order, order)], rows, metric, source, path, config.dpi)
        written["similarity_heatmap"] = str(path)
        result.update(heatmap_rows=rows.tolist(), metric=metric, similarity_source=source)
    path = out / "class_norms.png"
    _histogram(norms.row, path, config.dpi)
    written["class_norms"] = str(path)
    if norms.names:
        path = out / "param_norms.png"
        _bars(norms.names, norms.param_total, path, config.dpi)
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
