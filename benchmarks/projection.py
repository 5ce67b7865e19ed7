"""Projection throughput (``classgrad.workers.projection.Projector``) next to this machine's float32
matmul throughput, measured in the same run.

For each batch size b the projection of rows [b, D] to k columns (R generated block by block,
never held whole) is timed, and so is the same work without generation: ``addmm`` of the same
row slices with one pre-generated block of the same shape, i.e. ``torch.mm`` of exactly the
sizes the projection runs. The two are interleaved and repeated; the best time of each is
kept (this is a shared machine, and the best run is the least disturbed one). Throughput is
2 * b * D * k / seconds. The goal (issue 8): projection >= 50% of the matmul throughput, at
k = 4096 and D = 1M. A square 4096^3 ``torch.mm`` is also reported, as the machine's peak.

Generation costs the same for any b, while the matmul grows with b, so the ratio rises with
b: roughly t_mm(b) / (t_mm(b) + t_gen). ``t_gen`` (ns per entry of R) is measured separately
and printed, so the table can be read for other batch sizes too.

    .venv/bin/python -m benchmarks.projection            # D = 2^20, k = 4096, b = 64, 256, 1024
    .venv/bin/python -m benchmarks.projection --quick    # D = 2^18, b = 64, 256
    .venv/bin/python -m benchmarks.projection --device cuda
    .venv/bin/python -m benchmarks.projection --threads 1 --clock cpu   # on a busy machine

Prints a table and writes ``benchmarks/out/projection.json``.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from benchmarks import common
from benchmarks.common import print_table
from classgrad.workers.projection import HASH_NAME, Projector

GOAL = 0.50
OUT = common.OUT_DIR / "projection.json"


def matmul_only(x: torch.Tensor, block: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The projection's matmuls without its generation: same slices, same shapes, one block."""
    d = x.shape[1]
    acc = torch.zeros(x.shape[0], block.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, d, block_rows):
        stop = min(d, start + block_rows)
        acc.addmm_(x[:, start:stop], block[: stop - start])
    return acc


def generation_ns_per_entry(p: Projector, device: torch.device, reps: int) -> float:
    """Seconds to generate R's blocks (no matmul), per entry, best of ``reps``."""
    block_rows = p.block_rows_for(device)
    blocks = max(1, min(p.dim_in // block_rows, (1 << 25) // (block_rows * p.dim) + 1))
    buf = torch.empty(block_rows * p._kind.buffer_cols(p.dim), dtype=torch.float32, device=device)

    def run() -> None:
        for i in range(blocks):
            p._generate(0, i * block_rows, (i + 1) * block_rows, device, buf)

    best = common.interleaved({"generate": run}, reps, device)["generate"].best  # after a warm-up run
    return best / (blocks * block_rows * p.dim) * 1e9


def peak_matmul_gflops(device: torch.device, reps: int, n: int = 4096) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = common.interleaved({"mm": lambda: torch.mm(a, b)}, reps, device)["mm"].best  # after a warm-up run
    return 2 * n**3 / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D = 2^18, b = 64, 256, 2 repetitions")
    parser.add_argument("--dim-in", type=int, help="row width D (default 2^20, quick 2^18)")
    parser.add_argument("--dim", type=int, default=4096, help="projection dimension k")
    parser.add_argument("--batch", help="comma-separated batch sizes b (default 64,256,1024; quick 64,256)")
    parser.add_argument("--kinds", default="rademacher,gaussian", help="comma-separated kinds")
    parser.add_argument(
        "--gaussian-batch",
        type=int,
        default=None,
        help="b for the gaussian kind (default: the largest b; its generation is "
        "slow on a CPU, so it is measured at one b only)",
    )
    parser.add_argument(
        "--block-rows",
        help="rows of R per block; a comma-separated list compares "
        "several (default: the projector's choice for the device)",
    )
    parser.add_argument("--reps", type=int, help="repetitions, best kept (default 3, quick 2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["cpu", "wall"],
        help="wall: elapsed time; cpu: this process's CPU time, which other "
        "processes on a shared machine disturb far less (use with --threads 1; "
        "with more threads it also counts their spin-waiting)",
    )
    parser.add_argument("--out", default=str(OUT), help="JSON output path")
    args = parser.parse_args(argv)

    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu only measures CPU work")
    common.set_clock(args.clock)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    d = args.dim_in or (1 << 18 if args.quick else 1 << 20)
    k = args.dim
    batches = [int(b) for b in (args.batch or ("64,256" if args.quick else "64,256,1024")).split(",")]
    reps = args.reps or (2 if args.quick else 3)
    kinds = [s for s in args.kinds.split(",") if s]
    gauss_b = args.gaussian_batch or max(batches)

    print(
        f"device {device} ({platform.processor() or platform.machine()}), threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}, D={d}, k={k}, reps={reps}, "
        f"clock {args.clock}",
        flush=True,
    )
    peak = peak_matmul_gflops(device, reps)
    print(f"square 4096^3 float32 matmul: {peak:.0f} GFLOP/s", flush=True)

    load_before = os.getloadavg()
    x_all = torch.randn(max(batches), d, device=device)
    results = []
    gen_rates: dict[str, float] = {}
    block_choices = [int(v) for v in args.block_rows.split(",")] if args.block_rows else [None]
    for kind in kinds:
        for choice in block_choices:
            p = Projector(d, k, kind=kind, seed=0, block_rows=choice)
            block_rows = p.block_rows_for(device)
            rate = generation_ns_per_entry(p, device, reps)
            gen_rates[f"{kind}/{block_rows}"] = rate
            print(
                f"{kind}: block_rows {block_rows}, generation {rate:.3f} ns per entry "
                f"({rate * d * k / 1e9:.2f} s for the whole {d} x {k} R)",
                flush=True,
            )
            block = p.matrix_block(0, 0, min(block_rows, d), device)
            for b in batches:
                if kind != "rademacher" and b != gauss_b:
                    continue
                x = x_all[:b]
                # Interleaved, so a disturbance hits both; no warm-up (generation and peak ran first).
                t = common.interleaved(
                    {"matmul": lambda: matmul_only(x, block, block_rows), "project": lambda: p.project(x)},  # noqa: B023 - called within this iteration
                    reps,
                    device,
                    warmup=False,
                )
                best_mm, best_proj = t["matmul"].best, t["project"].best
                flops = 2 * b * d * k
                row = {
                    "kind": kind,
                    "b": b,
                    "dim_in": d,
                    "k": k,
                    "block_rows": block_rows,
                    "project_s": best_proj,
                    "matmul_s": best_mm,
                    "project_gflops": flops / best_proj / 1e9,
                    "matmul_gflops": flops / best_mm / 1e9,
                    "rows_per_s": b / best_proj,
                    "generation_ns_per_entry": rate,
                }
                row["ratio"] = row["project_gflops"] / row["matmul_gflops"]
                row["ratio_to_peak"] = row["project_gflops"] / peak
                row["goal_met"] = row["ratio"] >= GOAL
                results.append(row)
                print(
                    f"  b={b}: project {best_proj:.2f} s, matmul-only {best_mm:.2f} s, ratio {row['ratio']:.2f}",
                    flush=True,
                )
    load_after = os.getloadavg()

    print()
    print_table(
        ["kind", "b", "block", "proj s", "proj GF/s", "mm GF/s", "ratio", "vs peak", "rows/s", ">=50%"],
        [
            [
                r["kind"],
                r["b"],
                r["block_rows"],
                f"{r['project_s']:.2f}",
                f"{r['project_gflops']:.1f}",
                f"{r['matmul_gflops']:.1f}",
                f"{r['ratio']:.2f}",
                f"{r['ratio_to_peak']:.2f}",
                f"{r['rows_per_s']:.1f}",
                "yes" if r["goal_met"] else "no",
            ]
            for r in results
        ],
    )
    print(
        f"\nmatmul = torch.mm of the projection's own shapes without generation; peak = square "
        f"4096^3 mm ({peak:.0f} GFLOP/s). Goal: ratio >= {GOAL:.0%}."
    )
    print(
        f"1-min load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on "
        f"{os.cpu_count()} CPUs (other processes disturb CPU timings)"
    )

    common.write_report(
        args.out,
        {
            "benchmark": "projection",
            "machine": common.machine_info(),
            "device": str(device),
            "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "hash": HASH_NAME,
            "dim_in": d,
            "k": k,
            "reps": reps,
            "quick": args.quick,
            "clock": args.clock,
            "peak_matmul_gflops": peak,
            "generation_ns_per_entry": gen_rates,
            "load_average_before_after": [load_before, load_after],
            "goal": GOAL,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
