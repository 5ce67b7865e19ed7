"""Nearest neighbours and the worst pairs over all C classes: the default projection's tail (issue 44).

For each model, ``Q`` query classes (evenly spaced) against **all** C classes: the exact rows
are computed in blocks of classes (the partitioned engine, float32; never all C at once), and
their cosines to the queries compared with those of

- ``default``: the rows a job stores with ``projection: {dim: k}`` (tensorsketch, ``chunked``
  placement), from the engine in the backward;
- ``hashed``: the placement of stores made before (``tensor_sketch.SketchUnit``, a hash per
  axis), applied to the exact rows: what those stores hold;
- ``countsketch``: an independent CountSketch (one signed entry per coordinate, another seed) of
  the exact rows, the reference of the targets; with ``--second-sketch``, ``countsketch 2``, one
  more of another seed: how far two draws of the same map differ with ``Q`` queries.

Reported per method: top-1 agreement (the query's nearest other class is the exact one), recall@10,
the median and the worst absolute cosine error over the ``Q x (C - 1)`` pairs, and the share of
queries with some pair off by more than 0.3. Targets (issue 44): top-1 and recall@10 at least the
CountSketch's minus 0.05, the worst error at most 1.5x the CountSketch's, on every model.

Models: ``cnn`` (issue 44's own CNN: two 3x3 convolutions, 8 and 16 channels, pooled to 64
features, a 64 -> C head; D = 651,392 at C = 10,000; 16 px images), ``hf_resnet`` and
``bag_text`` (``projection_scale``'s, 2 samples per class), ``bert`` (``real_model_cases``' tiny
Hugging Face BERT, hidden 64, 1-4 samples per class).

    .venv/bin/python -m benchmarks.projection_tail                   # C = 10,000 (BERT 2,000), k = 4,096 and 1,024
    .venv/bin/python -m benchmarks.projection_tail --models cnn --dims 4096 --queries 50
    .venv/bin/python -m benchmarks.projection_tail --models hf_resnet --dims 1024 --queries 300 --second-sketch
    .venv/bin/python -m benchmarks.projection_tail --quick           # C = 1,000, k = 256, two models

Prints a table, asserts nothing; writes ``benchmarks/out/projection_tail.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks.projection_scale import build as scale_build

OUT = common.OUT_DIR / "projection_tail.json"
CLASSES = {"cnn": 10000, "hf_resnet": 10000, "bag_text": 10000, "bert": 2000}
BLOCK_BYTES = 1 << 31  # exact rows held at once


class SmallCNN(nn.Module):
    """Issue 44's own CNN: conv 3 -> 8, conv 8 -> 16 (3x3), pooled to 2x2 (64 features), head 64 -> C."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(name: str, classes: int) -> tuple[nn.Module, Any]:
    """``(model, samples)`` with seeded weights and data."""
    if name == "cnn":
        torch.manual_seed(0)
        labels = torch.arange(classes).repeat_interleave(2)
        images = torch.randn(len(labels), 3, 16, 16, generator=torch.Generator().manual_seed(1))
        return SmallCNN(classes).eval(), (images, labels)
    model, samples, _ = scale_build(name, classes)
    return model, samples


def _unit_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-30)


def tail_stats(cos: torch.Tensor, exact: torch.Tensor, queries: torch.Tensor) -> dict[str, float]:
    """``cos``, ``exact``: ``[Q, C]`` cosines of the queries to every class (float64)."""
    own = torch.zeros_like(exact, dtype=torch.bool)
    own[torch.arange(len(queries)), queries] = True
    err = (cos - exact).abs().masked_fill(own, 0)
    mine, want = cos.masked_fill(own, -9), exact.masked_fill(own, -9)
    found, truth = mine.topk(10, dim=1).indices, want.topk(10, dim=1).indices
    return {
        "top1": float((found[:, 0] == truth[:, 0]).double().mean()),
        "recall10": float((found.unsqueeze(2) == truth.unsqueeze(1)).any(2).double().mean()),
        "median": float(err[~own].median()),
        "worst": float(err.max()),
        "share_over_0.3": float((err.max(dim=1).values > 0.3).double().mean()),
    }


def measure(
    name: str, classes: int, dims: list[int], n_queries: int, batch_size: int, second_sketch: bool = False
) -> list[dict[str, Any]]:
    from classgrad.workers.gradients import build_engine, projection_options
    from classgrad.workers.projection import SketchUnit
    from classgrad.workers.projection.sketch.row_sketch import RowSketch
    from classgrad.workers.projection.tensorsketch.tensorsketch_map import HASHED, TensorSketchMap

    model, samples = build(name, classes)
    queries = torch.linspace(0, classes - 1, n_queries).round().long().unique()
    t0 = time.perf_counter()
    seeds = {"countsketch": 99, **({"countsketch 2": 98} if second_sketch else {})}
    defaults, hashed, sketches = {}, {}, {}
    for k in dims:
        proj = projection_options({"dim": k})
        eng = build_engine(model, samples, num_classes=classes, batch_size=batch_size, projection=proj)
        defaults[k] = eng.compute(range(classes)).rows
        kmap = eng.kmap
        units = [SketchUnit(u.index, u.weight, u.bias, u.a, u.b, u.input_first, k, 1, u.seed) for u in kmap.units]
        hashed[k] = TensorSketchMap(kmap.slots, units, dim=k, seed=kmap.seed, nonzeros=kmap.nonzeros, placement=HASHED)
        width = sum(s.size for s in kmap.slots)
        sketches[k] = {m: RowSketch(width, k, nonzeros=1, seed=seed) for m, seed in seeds.items()}
    projected_s = time.perf_counter() - t0
    exact_eng = build_engine(model, samples, num_classes=classes, batch_size=batch_size)
    q_rows = _unit_rows(exact_eng.compute(queries.tolist()).rows)
    width = q_rows.shape[1]
    block = max(1, BLOCK_BYTES // (4 * width))
    exact = torch.empty(len(queries), classes, dtype=torch.float64)
    others = {(method, k): torch.empty(classes, k) for method in ("hashed", *seeds) for k in dims}
    t0 = time.perf_counter()
    for start in range(0, classes, block):
        part = range(start, min(classes, start + block))
        full = exact_eng.compute(part).rows
        exact[:, start : part.stop] = (q_rows @ _unit_rows(full).t()).double()
        for k in dims:
            others["hashed", k][start : part.stop] = hashed[k].project_full(full)
            for method, sketch in sketches[k].items():
                others[method, k][start : part.stop] = sketch.project(full)
        del full
    exact_s = time.perf_counter() - t0
    results = []
    for k in dims:
        methods = {"default": defaults[k], **{m: others[m, k] for m in ("hashed", *seeds)}}
        row: dict[str, Any] = {"model": name, "classes": classes, "dim": k, "queries": len(queries), "D": width}
        for method, rows in methods.items():
            unit = _unit_rows(rows.double())
            row[method] = tail_stats(unit[queries] @ unit.t(), exact, queries)
        row["seconds"] = {"projected": projected_s, "exact_blocks": exact_s}
        results.append(row)
    return results


def _fmt(r: dict[str, Any]) -> list[Any]:
    cells: list[Any] = [r["model"], f"{r['classes']:,}", f"{r['dim']:,}"]
    for method in ("default", "hashed", "countsketch", "countsketch 2"):
        if method not in r:
            continue
        s = r[method]
        parts = (f"{s['top1']:.2f}", f"{s['recall10']:.2f}", f"{s['median']:.4f}", f"{s['worst']:.3f}")
        cells.append(" / ".join((*parts, f"{s['share_over_0.3']:.2f}")))
    d, c = r["default"], r["countsketch"]
    met = d["top1"] >= c["top1"] - 0.05 and d["recall10"] >= c["recall10"] - 0.05 and d["worst"] <= 1.5 * c["worst"]
    cells += [f"{d['worst'] / c['worst']:.2f}x", "met" if met else "MISSED"]
    return cells


def headers(rows: list[dict[str, Any]]) -> list[str]:
    second = ["countsketch 2"] if any("countsketch 2" in r for r in rows) else []
    return [
        "model", "C", "k", "default: top1 / r@10 / median / worst / >0.3", "hashed (old stores)", "countsketch",
        *second, "worst / CS", "targets",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CLASSES))
    ap.add_argument("--classes", type=int, help="C for every model (default: 10,000; BERT 2,000)")
    ap.add_argument("--dims", default="4096,1024")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--second-sketch", action="store_true", help="a second CountSketch (another seed): its spread")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.models, args.classes, args.dims, args.queries = "cnn,bag_text", 1000, "256", 50
    torch.set_num_threads(args.threads)
    dims = [int(d) for d in args.dims.split(",")]
    results = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        rows = measure(name, args.classes or CLASSES[name], dims, args.queries, args.batch_size, args.second_sketch)
        print(f"{name}: {time.perf_counter() - t0:.0f} s")
        common.print_table(headers(rows), [_fmt(r) for r in rows])
        results += rows
    print("\n== all")
    common.print_table(headers(results), [_fmt(r) for r in results])
    common.write_report(OUT, {"machine": common.machine_info(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
