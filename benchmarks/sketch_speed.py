"""Speed of the sparse sign sketch (``projection.rest: sketch``) against the dense projection of the same rows.

Rows ``[b, D]`` the size of the ViT's Kronecker rest in ``projected_job.py --model vit`` (D =
445,548 parameters, k = 1,416 columns, b = 150 rows: what the engine gathers per call) projected
by ``SparseSignSketch`` with each ``s`` and by a dense Rademacher ``Projector``; milliseconds per
row, best of ``--reps``, one thread.

    .venv/bin/python -m benchmarks.sketch_speed
    .venv/bin/python -m benchmarks.sketch_speed --dim-in 1000000 --dim 4096 --nonzeros 4

Prints a table and writes ``benchmarks/out/sketch_speed.json``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import common
from benchmarks.common import print_table

OUT = common.OUT_DIR / "sketch_speed.json"


def best_ms_per_row(project, x: torch.Tensor, reps: int) -> float:
    project(x)  # warm-up (the sketch caches its indices, the projector its buffers)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        project(x)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best / x.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim-in", type=int, default=445_548, help="D: columns of the rows")
    parser.add_argument("--dim", type=int, default=1416, help="k: columns projected to")
    parser.add_argument("--rows", type=int, default=150, help="b: rows per call")
    parser.add_argument("--nonzeros", type=int, nargs="+", default=[1, 2, 4, 8], help="s of the sketch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from classgrad.workers.projection import Projector
    from classgrad.workers.projection.sketch.row_sketch import SparseSignSketch

    x = torch.randn(args.rows, args.dim_in, generator=torch.Generator().manual_seed(0))
    results = {}
    for s in args.nonzeros:
        sk = SparseSignSketch(args.dim_in, args.dim, nonzeros=s)
        results[f"sketch s={s}"] = best_ms_per_row(sk.project, x, args.reps)
    results["dense rademacher"] = best_ms_per_row(Projector(args.dim_in, args.dim).project, x, args.reps)
    dense = results["dense rademacher"]
    table = [[name, f"{ms:.2f} ms", f"{ms / dense:.3f}x"] for name, ms in results.items()]
    print(f"\n== D = {args.dim_in:,} -> k = {args.dim:,}, b = {args.rows} rows per call, 1 thread, best of {args.reps}")
    print_table(["projection", "per row", "vs dense"], table)
    common.write_report(args.out, {"machine": common.machine_info(), "args": vars(args), "ms_per_row": results})


if __name__ == "__main__":
    main()
