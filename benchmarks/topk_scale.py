"""Top-k similarity against its floor, and its plan at 1,000,000 classes (issue 55, item 5).

The floor is a plain numpy blocked matmul over the same rows: X[a:b] @ X.T for row blocks of
``--floor-block`` rows, the rows already in memory (read before the clock starts), nothing kept.
Against it, ``compute_similarity(dense=False, top_k=K)`` with the local executor: reads the rows
from the store, the cosine norms, the products, the merge of each window's top-k, the table
written. Both run in fresh child processes, one after the other in the same run, with the same
number of BLAS threads (``--threads``); each reports wall and CPU time and its peak RSS above
its start (ours against ``--task-mb``).

Then the planner alone at the sizes this machine cannot run: 1,000,000 x 4,096 float32 rows on
100 and 1,000 CPUs, at several ``--task-mb``: tasks, query blocks, candidate parts, passes over
the store and bytes read.

    .venv/bin/python -m benchmarks.topk_scale                           # 100,000 x 1,024, top-10
    .venv/bin/python -m benchmarks.topk_scale --classes 20000 --quick   # a smoke run

Writes ``benchmarks/out/topk_scale.json``. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.similarity import build_store

OUT = Path(__file__).resolve().parent / "out" / "topk_scale.json"
MIB = 1 << 20
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def floor_matmul(path: str, block: int) -> dict:
    """The floor, in a child: every block of rows times every row, in float32, nothing kept."""
    import numpy as np

    from classgrad.service.analysis.memory import PeakMemory
    from classgrad.store import open_store

    x = np.ascontiguousarray(open_store(path).rows(slice(None)))
    meter = PeakMemory()
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = np.empty((block, x.shape[0]), dtype=np.float32)
    for a in range(0, x.shape[0], block):
        q = x[a : a + block]
        np.matmul(q, x.T, out=out[: len(q)])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = meter.close()
    return {"seconds": seconds, "cpu_seconds": cpu, "rss_added": peak - meter.start}


def ours(path: str, top_k: int, task_mb: float) -> dict:
    """``compute_similarity`` top-k only, in a child, with the local executor."""
    import torch  # noqa: F401 - imported before the clock: the import is not the work's

    from classgrad.service.analysis.similarity import compute_similarity

    t0, cpu0 = time.perf_counter(), time.process_time()
    summary = compute_similarity(path, executor="local", dense=False, top_k=top_k, task_mb=task_mb)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    keep = ("tasks", "block_rows", "part_rows", "window_rows", "stream_rows", "passes", "read_bytes")
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rss_added": summary["peak_task_rss_added_bytes"],
        "bound": summary["memory_bound_bytes"],
        **{k: summary[k] for k in keep},
    }


def in_child(fn, threads: int, *args):
    for var in THREAD_VARS:
        os.environ[var] = str(threads)  # read by the child's BLAS when it loads
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def plans_at_scale(task_mbs: list[float]) -> list[dict]:
    """The planner's tiles for 1,000,000 x 4,096 float32 rows (no store needed: its sizes)."""
    from classgrad.service.analysis.similarity import SimilarityConfig
    from classgrad.service.analysis.topk_plan import plan_topk

    store = SimpleNamespace(num_classes=1_000_000, dim=4096, row_chunk=16, col_chunk=4096)
    size = store.num_classes * store.dim * 4
    rows = []
    for workers in (100, 1000):
        for mb in task_mbs:
            plan = plan_topk(store, SimilarityConfig(task_mb=mb), workers=workers)
            rows.append(
                {
                    "cpus": workers,
                    "task_mb": mb,
                    "tasks": len(plan.tasks()),
                    "blocks": len(plan.blocks()),
                    "block_rows": plan.block_rows,
                    "parts": len(plan.parts()),
                    "passes": plan.passes(),
                    "read_tib": plan.passes() * size / (1 << 40),
                    "bound_mib": plan.memory_bound()["total"] / MIB,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--task-mb", type=float, default=512.0)
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads of both children")
    parser.add_argument("--floor-block", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="skip the plans at scale")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="topk-scale-"))
    try:
        path = work / "store"
        build_s = build_store(path, args.classes, args.dim)
        floor = in_child(floor_matmul, args.threads, str(path), args.floor_block)
        mine = in_child(ours, args.threads, str(path), args.top_k, args.task_mb)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "classes": args.classes,
        "dim": args.dim,
        "top_k": args.top_k,
        "threads": args.threads,
        "build_s": build_s,
        "floor": floor,
        "ours": mine,
        "ratio_wall": mine["seconds"] / floor["seconds"],
        "ratio_cpu": mine["cpu_seconds"] / floor["cpu_seconds"],
        "load_average": os.getloadavg(),
        "plans": [] if args.quick else plans_at_scale([512, 2048, 8192]),
    }
    print(f"{args.classes:,} x {args.dim:,} float32 ({args.classes * args.dim * 4 / MIB:,.0f} MiB), top-{args.top_k}:")
    print(
        f"  floor (numpy X[a:b] @ X.T, blocks of {args.floor_block}): {floor['seconds']:.1f} s wall, "
        f"{floor['cpu_seconds']:.1f} s CPU"
    )
    print(
        f"  classgrad top-k: {mine['seconds']:.1f} s wall, {mine['cpu_seconds']:.1f} s CPU; {mine['tasks']} tasks of "
        f"{mine['block_rows']} query rows x {mine['part_rows']} candidates, windows of {mine['window_rows']}, "
        f"store read {mine['passes']} times; peak +{mine['rss_added'] / MIB:.0f} MiB (bound {mine['bound'] / MIB:.0f})"
    )
    print(f"  ratio: {result['ratio_wall']:.2f}x wall, {result['ratio_cpu']:.2f}x CPU (load {os.getloadavg()[0]:.1f})")
    if result["plans"]:
        print("plans at 1,000,000 x 4,096 float32 (15.3 GiB):")
        print("  CPUs  task MiB   tasks  blocks x rows    parts  passes  read TiB  bound MiB")
        for r in result["plans"]:
            print(
                f"  {r['cpus']:>4}  {r['task_mb']:>8.0f}  {r['tasks']:>6}  {r['blocks']:>6} x {r['block_rows']:<7}"
                f"  {r['parts']:>5}  {r['passes']:>6}  {r['read_tib']:>8.1f}  {r['bound_mib']:>9.0f}"
            )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
