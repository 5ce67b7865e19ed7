"""ResNet-18 with 10,000 classes on a GPU: classgrad's engines next to the alternatives, in fp32,
fp16 and bf16, with rows/s, ratios, and GPU kernel time against wall time (issue 6, GPU part).

The model is ``classgrad.workers.zoo.resnet18`` (11M parameters plus a 512 x C head: D = 16.3M at
C = 10,000) in eval mode, on 32x32 images, the loss the class-partitioned mean cross-entropy.
Every row is 65 MB, so all 10,000 cannot be held: each method computes the rows of ``--rows``
evenly spaced classes (``--spc`` probe samples each, the probe set being those classes'
samples), and rows/s is per computed row. Partitioned rows only involve their own class's
samples, so this is the per-row rate of the whole matrix. The floor is one forward+backward of
the summed loss over the same samples. The loops are timed on ``--loop-classes`` of the rows
and extrapolated per row (said in the table). TRAK-style per-sample gradients run
``--sample-chunk`` samples at a time. Opacus-style hooks are not run: this model has BatchNorm
parameters (Opacus itself refuses BatchNorm).

"Kernel time / wall" is the sum of the GPU kernel times that torch.profiler records for one run
of the method, over the method's best wall time in the timed runs: near 1 means the GPU is kept
busy, far below 1 means the method is launch- or host-bound. fp16 alternatives use a fixed loss
scale of 1024; classgrad scales per row and recomputes overflowed rows.

Run on a GPU machine (needs no Ray):

    .venv/bin/python -m benchmarks.gpu_resnet18                     # cuda, fp32/fp16/bf16, 128 rows
    .venv/bin/python -m benchmarks.gpu_resnet18 --device cpu --quick   # CPU smoke test (fp32, 4 rows)

Prints a table per precision and writes ``benchmarks/out/gpu_resnet18.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks import common
from benchmarks.alternatives import add, run_table, subset
from benchmarks.common import Case, fmt_s, print_table
from classgrad.workers import zoo

OUT = common.OUT_DIR / "gpu_resnet18.json"


def make_resnet_case(args, precision: str) -> Case:
    C = args.classes
    chosen = torch.tensor(subset(C, args.rows))
    x, y = zoo.synthetic_probe(
        len(chosen), args.spc, kind="image", input_shape=(3, args.image_size, args.image_size), seed=0
    )
    model = zoo.resnet18(C, small_inputs=True, seed=0).eval()
    return Case(
        f"resnet18 C={C:,}, {len(chosen)} rows x {args.spc}/class",
        model,
        x,
        chosen[y],
        C,
        precision=precision,
        device=torch.device(args.device),
        batch_size=args.batch_size,
    )


def run_precision(args, precision: str) -> dict[str, Any]:
    case = make_resnet_case(args, precision)
    rows = torch.unique(case.y).tolist()
    loop_k = subset(len(rows), args.loop_classes)
    loop_classes = [rows[i] for i in loop_k]
    alt_k = [rows[i] for i in subset(len(rows), args.alt_rows)]
    m: dict = {}
    # The loops and batched VJPs extrapolate from their subset to all C; here the "matrix" is
    # the chosen rows, so rescale their per-row extrapolation to len(rows).
    scale_to_rows = len(rows) / case.num_classes
    add(
        m,
        "seed_loop",
        lambda h: _rescaled(common.seed_loop(case, loop_classes, h), scale_to_rows),
        f"{len(loop_classes)} of {len(rows)} rows, extrapolated",
    )
    add(
        m,
        "grad_loop",
        lambda h: _rescaled(common.grad_loop(case, loop_classes, h), scale_to_rows),
        f"{len(loop_classes)} of {len(rows)} rows, extrapolated",
    )
    add(
        m,
        f"batched_onehot[{args.chunk}]",
        lambda h: _rescaled(common.batched_onehot(case, alt_k, h, args.chunk), scale_to_rows),
        f"{len(alt_k)} of {len(rows)} rows, extrapolated" if len(alt_k) < len(rows) else "",
    )
    add(
        m,
        f"jacrev[{args.chunk}]",
        lambda h: _rescaled(common.func_jacrev(case, alt_k, h, args.chunk), scale_to_rows),
        f"{len(alt_k)} of {len(rows)} rows, extrapolated" if len(alt_k) < len(rows) else "",
    )
    add(
        m,
        "trak_vmap",
        lambda h: common.trak_vmap(case, h, sample_chunk=args.sample_chunk),
        f"{args.sample_chunk} samples per vmap",
    )
    add(m, "floor", lambda h: common.floor_partitioned(case), "writes no rows")
    add(
        m,
        "classgrad_dense",
        lambda h: _rescaled(common.classgrad(case, h, "dense", alt_k), scale_to_rows),
        f"{len(alt_k)} of {len(rows)} rows, extrapolated" if len(alt_k) < len(rows) else "",
    )
    add(m, "classgrad_partitioned", lambda h: _rescaled(common.classgrad(case, h, "partitioned", rows), scale_to_rows))

    results = run_table(case, m, "classgrad_partitioned", args.reps)
    for r in results.values():
        r["rows_per_s"] = len(rows) / r["seconds"]  # per computed row (run_table's is per class of C)
    for _, holder, _ in m.values():
        holder.clear()  # the rows (65 MB each) are checked: free them before the profiled runs
    t_eng = results["classgrad_partitioned"]["seconds"]
    for name in ("floor", "classgrad_partitioned", "trak_vmap"):
        if "error" in results[name]:
            continue
        # Wall time: the best of the timed runs above (the same callable, synchronised); the
        # profiled run only gives the kernel time (and is skipped off CUDA).
        wall = results[name]["seconds"]
        k = common.kernel_time(m[name][0], case.device)
        results[name]["profiled_wall_s"] = wall
        results[name]["kernel_s"] = k
        results[name]["kernel_over_wall"] = None if k is None else k / wall
    alts = {n: r["seconds"] for n, r in results.items() if not n.startswith(("classgrad", "floor"))}
    best_alt = min(alts, key=alts.get)
    summary = {
        "rows": len(rows),
        "dim": case.dim,
        "engine_s": t_eng,
        "floor_s": results["floor"]["seconds"],
        "engine_over_floor": t_eng / results["floor"]["seconds"],
        "best_alternative": best_alt,
        "speedup_vs_best_alternative": alts[best_alt] / t_eng,
        "speedup_vs_seed_loop": results["seed_loop"]["seconds"] / t_eng,
    }
    print(f"\n== {case.name}, D = {case.dim:,}, {precision}, {case.device}")
    table = []
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["seconds"]):
        check = "-" if "allclose" not in r else ("ok" if r["allclose"] else "DIFFERS") + f" ({r['max_rel_err']:.1e})"
        check = "FAILED" if "error" in r else check
        kw = r.get("kernel_over_wall")
        table.append(
            [
                name,
                fmt_s(r["seconds"]),
                f"{r['rows_per_s']:,.1f}",
                f"{r['seconds'] / t_eng:.2f}x",
                check,
                "-" if kw is None else f"{kw:.2f}",
                r["note"],
            ]
        )
    print_table(
        ["method", "time (best)", "rows/s", "vs classgrad_partitioned", "allclose", "kernel/wall", "note"], table
    )
    print(
        f"partitioned: {summary['speedup_vs_best_alternative']:.2f}x the fastest alternative ({best_alt}), "
        f"{summary['engine_over_floor']:.2f}x the floor, {summary['speedup_vs_seed_loop']:.0f}x the seed-style loop"
    )
    return {"results": results, "summary": summary}


def _rescaled(fn, factor: float):
    """Methods that extrapolate to all C report per-row time x C; bring it to x rows."""

    def run():
        out = fn()
        if isinstance(out, dict) and "seconds" in out:
            return {"seconds": out["seconds"] * factor}
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="few rows, fp32 only on a CPU, 1 repetition")
    parser.add_argument("--classes", type=int, default=10000, help="C (model outputs)")
    parser.add_argument("--rows", type=int, help="rows computed per method (default 128 on cuda; quick 4)")
    parser.add_argument("--spc", type=int, default=4, help="probe samples per class")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precisions", help="comma-separated (default fp32,fp16,bf16; quick on cpu: fp32)")
    parser.add_argument("--loop-classes", type=int, help="rows the loops are timed on (default 8, quick 2)")
    parser.add_argument("--alt-rows", type=int, help="rows of batched VJPs, jacrev and dense (default 32, quick 2)")
    parser.add_argument("--chunk", type=int, default=16, help="chunk size of batched VJPs and jacrev")
    parser.add_argument("--sample-chunk", type=int, default=32, help="samples per vmap in TRAK-style per-sample grads")
    parser.add_argument("--reps", type=int, help="repetitions (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    q = args.quick
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device(args.device).type == "cpu"
    args.rows = args.rows or (4 if q else 128)
    args.loop_classes = args.loop_classes or (2 if q else 8)
    args.alt_rows = args.alt_rows or (2 if q else 32)
    args.reps = args.reps or (1 if q else 3)
    precisions = (args.precisions or ("fp32" if q and cpu else "fp32,fp16,bf16")).split(",")
    clock = common.set_clock("wall")  # GPU work: wall time, synchronised
    report: dict[str, Any] = {"machine": common.machine_info(), "args": vars(args), "clock": clock, "precisions": {}}
    if cpu:
        print("note: running on the CPU (smoke test); GPU kernel time is not measured")
    for precision in precisions:
        report["precisions"][precision] = run_precision(args, precision)
        if torch.cuda.is_available():  # the case and its rows are gone with run_precision's frame
            torch.cuda.empty_cache()
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
