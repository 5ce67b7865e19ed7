"""What a store holds, at a glance: ``classgrad inspect``.

Holds ``GradNorms`` and ``grad_norms`` (per-class gradient norms and per-class x per-parameter
squared norms in one out-of-core pass over the rows of done shards, band by band), and
``inspect_store`` (format version, shape, dtype, chunks, parameter layout, completion, norm summaries, the
similarity if one is stored) as a JSON-ready dict, plus ``format_report`` (the text the
command prints; a projection's lines are its structure's, ``structures.summary_lines``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from classgrad.service.analysis import (
    DEFAULT_BLOCK_MB,
    completion,
    done_ranges,
    finite_summary,
    iter_tiles,
    plan_blocks,
)
from classgrad.units import fmt_bytes
from classgrad.workers.projection import neighbour_caveat, summary_lines

# What an older store lacks, beside its format version in the report.
_FORMAT_NOTES = {
    1: " (older: no shard records nor metadata digest; dimensions class/param, no coordinates)",
    2: " (older: dimensions class/param, no coordinates nor consolidated metadata: "
    "xr.open_zarr needs consolidated=False; classgrad.open_dataset reads it)",
}


@dataclass
class GradNorms:
    """Norms of the rows of done shards; rows of shards not done are NaN.

    ``row`` [C]: |g_c|. ``param_sq`` [C, P]: |g_c restricted to parameter p|^2, in layout
    order (P = 0 for projected stores). ``names``: the parameter names.
    """

    row: np.ndarray
    param_sq: np.ndarray
    names: list[str]

    @property
    def param_total(self) -> np.ndarray:
        """sqrt(sum over done classes of |g_c,p|^2): the norm of each parameter's columns."""
        return np.sqrt(np.nansum(self.param_sq, axis=0))

    def top(self, n: int) -> np.ndarray:
        """Rows of the (at most) ``n`` largest finite norms, largest first, ties by lower row."""
        finite = np.isfinite(self.row)
        ranked = np.argsort(-np.where(finite, self.row, -np.inf), kind="stable")
        return ranked[: min(n, int(finite.sum()))]


def _segments(offsets: np.ndarray, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
    """Split columns [c0, c1) at parameter boundaries: (starts relative to c0, parameter
    index of each piece)."""
    inside = offsets[(offsets > c0) & (offsets < c1)] - c0
    starts = np.concatenate(([0], inside)).astype(np.int64)
    params = np.searchsorted(offsets, c0 + starts, side="right") - 1
    return starts, params


def grad_norms(
    store,
    *,
    block_rows: int | None = None,
    block_mb: float = DEFAULT_BLOCK_MB,
    ranges: list[tuple[int, int]] | None = None,
) -> GradNorms:
    """One pass over the rows of done shards, in blocks of at most ``block_mb`` MiB; ``ranges``
    is ``done_ranges(store)`` when the caller already has it."""
    C = store.num_classes
    names = [e.name for e in store.layout]
    offsets = np.array([e.offset for e in store.layout], dtype=np.int64)
    row_sq = np.full(C, np.nan)
    param_sq = np.full((C, len(names)), np.nan)
    if ranges is None:
        ranges = done_ranges(store)
    for a, b in ranges:
        row_sq[a:b] = 0.0
        param_sq[a:b] = 0.0
    plan = plan_blocks(store, block_rows=block_rows, block_mb=block_mb)
    for r0, r1, c0, c1, x in iter_tiles(store, plan, ranges):
        sq = np.square(x, out=x)  # x is ours: square in place; sums accumulate in float64
        row_sq[r0:r1] += sq.sum(axis=1, dtype=np.float64)
        if names:
            starts, params = _segments(offsets, c0, c1)  # each parameter once per band
            param_sq[r0:r1, params] += np.add.reduceat(sq, starts, axis=1, dtype=np.float64)
        del x, sq
    return GradNorms(row=np.sqrt(row_sq), param_sq=param_sq, names=names)


def _class_label(store, row: int) -> dict:
    out = {"row": int(row), "class_id": int(store.class_ids[row])}
    names = store.class_names
    if names is not None:
        out["name"] = names[row]
    return out


def inspect_store(store, *, top: int = 5, block_rows: int | None = None, block_mb: float = DEFAULT_BLOCK_MB) -> dict:
    """Everything ``classgrad inspect`` shows, as a JSON-ready dict."""
    attrs = store.attrs
    comp = completion(store)  # the one read of shard_done
    norms = grad_norms(
        store, block_rows=block_rows, block_mb=block_mb, ranges=done_ranges(store, comp["missing_ranges"])
    )
    row = norms.row
    finite = np.isfinite(row)
    order = norms.top(top)
    loss = store.loss()
    info = {
        "store": store.url,
        "format_version": store.format_version,
        "shape": [store.num_classes, store.dim],
        "dtype": store.dtype,
        "storage_dtype": attrs.get("storage_dtype"),
        "stored_bytes": int(store.num_classes * store.dim * (4 if store.dtype == "float32" else 2)),
        "chunks": [store.row_chunk, store.col_chunk],
        "codec": attrs.get("codec"),
        "sharded": attrs.get("sharded"),
        "shard_rows": store.shard_rows,
        "loss_kind": attrs.get("loss_kind"),
        "projection": attrs.get("projection"),
        "fingerprint": store.fingerprint,
        "layout": [{"name": e.name, "shape": list(e.shape), "size": e.size, "offset": e.offset} for e in store.layout],
        "completion": comp,
        "class_norms": {
            **finite_summary(row),
            "zero_rows": int((row[finite] == 0).sum()),
            "top": [{**_class_label(store, i), "norm": float(row[i])} for i in order],
        },
        "loss": finite_summary(loss.astype(np.float64)),
        "param_norms": [],
        "similarity": store.similarity_info(),
        "runs": len(store.runs),
    }
    if norms.names:
        total_sq = np.nansum(norms.param_sq, axis=0)
        grand = float(total_sq.sum()) or 1.0
        per_class = np.sqrt(norms.param_sq[finite])
        for p, entry in enumerate(store.layout):
            info["param_norms"].append(
                {
                    "name": entry.name,
                    "shape": list(entry.shape),
                    "size": entry.size,
                    "norm": float(np.sqrt(total_sq[p])),
                    "mean_class_norm": float(per_class[:, p].mean()) if per_class.size else None,
                    "max_class_norm": float(per_class[:, p].max()) if per_class.size else None,
                    "share": float(total_sq[p] / grand),
                }
            )
    return info


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_report(info: dict) -> str:
    """The text ``classgrad inspect`` prints."""
    C, D = info["shape"]
    comp = info["completion"]
    lines = [
        f"store       {info['store']}",
        f"format      version {info['format_version']}{_FORMAT_NOTES.get(info['format_version'], '')}",
        f"rows        {C} classes x {D} {info['dtype']} ({fmt_bytes(info['stored_bytes'])} "
        f"stored, chunks {info['chunks'][0]} x {info['chunks'][1]}, codec {info['codec']}"
        f"{', sharded' if info['sharded'] else ''})",
        f"loss        {info['loss_kind'] or '-'}; fingerprint {info['fingerprint'] or '-'}",
        f"completion  {comp['shards_done']}/{comp['shards_total']} shards, {comp['rows_done']}/{C}"
        f" rows{'  complete' if comp['complete'] else ''}",
    ]
    if comp["missing_ranges"]:
        shown = ", ".join(f"[{a}, {b})" for a, b in comp["missing_ranges"][:5])
        more = " ..." if len(comp["missing_ranges"]) > 5 else ""
        lines.append(f"missing     rows {shown}{more}")
    proj = info["projection"]
    lines += summary_lines(proj, D)
    caveat = neighbour_caveat(proj)
    if caveat:
        lines.append(f"warning     {caveat}")
    if not proj and info["layout"]:
        lines.append(f"layout      {len(info['layout'])} parameters")
        width = max(len(e["name"]) for e in info["layout"])
        for e in info["layout"]:
            lines.append(f"  {e['name']:<{width}}  {str(tuple(e['shape'])):<18} {e['size']:>12,}")
    n = info["class_norms"]
    lines.append(
        f"class norms {n['n']} rows: min {_g(n['min'])}, median {_g(n['median'])}, "
        f"max {_g(n['max'])}; {n['zero_rows']} zero rows"
    )
    for t in n["top"]:
        label = f"class {t['class_id']}" + (f" ({t['name']})" if "name" in t else "")
        lines.append(f"  {label:<28} {t['norm']:.4g}")
    if info["param_norms"]:
        lines.append("param norms (over all done classes; share of the squared total)")
        width = max(len(p["name"]) for p in info["param_norms"])
        for p in info["param_norms"]:
            lines.append(
                f"  {p['name']:<{width}}  {p['norm']:>11.4g}  {100 * p['share']:5.1f}%  "
                f"mean per class {_g(p['mean_class_norm'])}"
            )
    loss = info["loss"]
    lines.append(f"loss        min {_g(loss['min'])}, median {_g(loss['median'])}, max {_g(loss['max'])}")
    sim = info["similarity"]
    if sim:
        lines.append(
            f"similarity  {sim.get('metric')}, top-{sim.get('top_k')}"
            + ("" if sim.get("dense", True) else " only (no matrix)")
            + f", {sim.get('state')}"
            + (f", {sim['seconds']:.1f} s" if "seconds" in sim else "")
        )
    return "\n".join(lines)
