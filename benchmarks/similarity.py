"""Class similarity at scale: ``classgrad similarity`` on Ray against one numpy process.

A synthetic store of C x D float32 rows (default 10,000 x 2,048 = 78 MiB) is written with
``write_rows``. For each block size, the cosine similarity and top-10 table are computed as
Ray tasks on a local Ray (one task per row block, 1 CPU each, reading their blocks from the
store and writing their strips back), and each task reports its peak resident memory. The
baseline is the same result in one process with numpy, everything in memory: read all rows,
normalise, X @ X.T, top-k (it fits here: the C x C float32 matrix is 381 MiB at 10k classes).

Memory. Each task measures the peak of its own process from its start (Linux: the kernel's
high-water mark, reset at task start) and reports ``rss_added`` = peak - RSS at the start; the
bound is ``SimilarityPlan.memory_bound()``: two row blocks, one read in flight, one block x
block product, the output strip (block_rows x C), zarr's write buffers, scratch and 16 MiB of
slack. Ray workers run with ``MALLOC_MMAP_THRESHOLD_`` set so that glibc returns freed blocks to
the system; otherwise memory kept by the allocator from a worker's previous task would hide in
the starting RSS. ``rss_peak - idle`` (the peak above an idle worker's RSS) is printed too. The
numpy baseline runs just before each Ray run (interleaved, so that changes in machine load hit
both).

Top-k section (``--section topk``): the top-k-only route, which never holds or writes C x C.
A store of C x D rows (default 100,000 x 1,024 float32 = 391 MiB, with the same structure) gets
``compute_similarity(dense=False, top_k=10)`` on a local Ray: time (wall, and the CPU time of
its tasks, which other processes on a shared machine do not change), tasks, query and stream
block sizes, each task's memory bound and measured peak (as above), and a check that no
``similarity`` array was written. The comparison runs at a C whose dense matrix fits in memory
here (default 20,000: 1.5 GiB): numpy in a child process (OpenBLAS limited to the Ray CPUs):
read all rows, normalise, X @ X.T, argpartition row block by row block; against the top-k
route on Ray at the same C, with how many of their neighbour indices agree.

    .venv/bin/python -m benchmarks.similarity                  # both sections, full sizes
    .venv/bin/python -m benchmarks.similarity --section topk   # 100,000 x 1,024; numpy at 20,000
    .venv/bin/python -m benchmarks.similarity --quick          # 10,000 x 256 (block 512); top-k 6,000 x 128

Prints a table per section and writes ``benchmarks/out/similarity.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from classgrad.service.analysis import fmt_bytes
from classgrad.service.analysis.memory import PeakMemory
from classgrad.service.analysis.similarity import compute_similarity, top_k_rows
from classgrad.store import StoreSpec, create_store, open_store

OUT = Path(__file__).resolve().parent / "out" / "similarity.json"
MIB = 1 << 20


def build_store(path: Path, classes: int, dim: int) -> float:
    """Rows with some structure (groups of classes share a direction); returns seconds."""
    t0 = time.perf_counter()
    spec = StoreSpec(
        num_classes=classes, dim=dim, shard_rows=512, row_chunk=64, col_chunk=dim, fingerprint="bench-similarity"
    )
    store = create_store(str(path), spec)
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((64, dim), dtype=np.float32)
    for shard in range(store.num_shards):
        a, b = store.shard_range(shard)
        rows = 0.5 * centers[rng.integers(0, 64, b - a)]
        rows += rng.standard_normal((b - a, dim), dtype=np.float32)
        store.write_rows(a, rows, loss=np.zeros(b - a), count=np.ones(b - a))
        store.mark_shard_done(shard)
    return time.perf_counter() - t0


def numpy_baseline(path: Path, top_k: int) -> dict:
    """Everything in one process, in memory; returns seconds and peak memory added."""
    meter = PeakMemory()
    t0 = time.perf_counter()
    x = open_store(str(path)).rows(slice(None))
    t_read = time.perf_counter() - t0
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x /= np.where(norms > 0, norms, 1)
    sim = x @ x.T
    t_gram = time.perf_counter() - t0 - t_read
    top_k_rows(sim, 0, top_k)
    seconds = time.perf_counter() - t0
    peak = meter.close()
    return {
        "seconds": seconds,
        "read_s": t_read,
        "gram_s": t_gram,
        "topk_s": seconds - t_read - t_gram,
        "rss_added": peak - meter.start,
    }


def idle_worker_rss(ray) -> int:
    """RSS of a worker that has imported what a task imports, doing nothing."""

    @ray.remote(num_cpus=1)
    def probe() -> int:
        import classgrad.service.analysis.similarity  # noqa: F401
        import classgrad.store  # noqa: F401
        from classgrad.service.analysis.memory import _rss

        return _rss()

    return max(ray.get([probe.remote() for _ in range(4)]))


def numpy_topk(path: str, top_k: int, block: int = 1024) -> dict:
    """Top-k of every row by numpy with the whole matrix in memory (run in a child process):
    read, normalise, X @ X.T, then argpartition ``block`` rows at a time (self excluded)."""
    meter = PeakMemory()
    t0, cpu0 = time.perf_counter(), time.process_time()
    x = open_store(path).rows(slice(None))
    t_read = time.perf_counter() - t0
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x /= np.where(norms > 0, norms, 1)
    sim = x @ x.T
    t_gram = time.perf_counter() - t0 - t_read
    C = sim.shape[0]
    index = np.empty((C, top_k), dtype=np.int64)
    for a in range(0, C, block):
        rows = sim[a : a + block]
        local = np.arange(rows.shape[0])
        rows[local, a + local] = -np.inf
        part = np.argpartition(rows, C - top_k, axis=1)[:, C - top_k :]
        vals = np.take_along_axis(rows, part, axis=1)
        index[a : a + block] = np.take_along_axis(part, np.argsort(-vals, axis=1, kind="stable"), axis=1)
    seconds = time.perf_counter() - t0
    peak = meter.close()
    return {
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu0,  # all of its BLAS threads
        "read_s": t_read,
        "gram_s": t_gram,
        "topk_s": seconds - t_read - t_gram,
        "rss_peak": peak,
        "rss_added": peak - meter.start,
        "index": index,
    }


def numpy_in_child(path: Path, top_k: int, threads: int) -> dict:
    """``numpy_topk`` in a fresh process whose BLAS uses ``threads`` threads."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)  # read by the child's numpy when it loads
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(numpy_topk, (str(path), top_k))


def topk_run(path: Path, top_k: int, idle: int) -> dict:
    """The top-k-only route on the running Ray; the summary's numbers and the task peaks."""
    s = compute_similarity(str(path), top_k=top_k, dense=False)
    reports = s["task_reports"]
    run = {
        "classes": s["num_classes"],
        "dim": s["dim"],
        "tasks": s["tasks"],
        "block_rows": s["block_rows"],
        "stream_rows": s["stream_rows"],
        "band_cols": s["band_cols"],
        "seconds": s["seconds"],
        "task_seconds": [r["seconds"] for r in reports],
        "task_cpu_seconds": sum(r["cpu_seconds"] for r in reports),
        "read_bytes": s["read_bytes"],
        "bound_bytes": s["memory_bound_bytes"],
        "bound_parts": s["memory_bound_parts"],
        "max_rss_added": max(r["rss_added"] for r in reports),
        "max_rss_above_idle": max(r["rss_peak"] for r in reports) - idle,
        "exact_peak": all(r["exact_peak"] for r in reports),
        "matrix_written": (path / "similarity").exists(),
    }
    run["within_bound"] = run["max_rss_added"] <= run["bound_bytes"] and not run["matrix_written"]
    return run


def topk_section(args: argparse.Namespace, workdir: Path, idle: int) -> dict:
    """The top-k route at C (time, memory per task) and against numpy at the comparison C."""
    C = args.topk_classes or (6_000 if args.quick else 100_000)
    D = args.topk_dim or (128 if args.quick else 1_024)
    C_np = args.numpy_classes or (6_000 if args.quick else 20_000)
    out: dict = {"classes": C, "dim": D, "numpy_classes": C_np, "top_k": args.top_k, "cpus": args.cpus}
    big = workdir / "topk.zarr"
    out["build_s"] = build_store(big, C, D)
    out["run"] = topk_run(big, args.top_k, idle)
    shutil.rmtree(big, ignore_errors=True)
    small = workdir / "numpy.zarr"
    build_store(small, C_np, D)
    base = numpy_in_child(small, args.top_k, args.cpus)
    same = topk_run(small, args.top_k, idle)
    ours = open_store(str(small)).similarity_neighbours()[0]
    same["agree_with_numpy"] = float((np.sort(ours, axis=1) == np.sort(base.pop("index"), axis=1)).mean())
    out["same_c"] = {"topk": same, "numpy": base, "ratio_to_numpy": same["seconds"] / base["seconds"]}
    return out


def print_topk(t: dict) -> None:
    r = t["run"]
    print(
        f"\ntop-{t['top_k']} only (cosine) of {t['classes']:,} x {t['dim']:,} float32 "
        f"({t['classes'] * t['dim'] * 4 / MIB:.0f} MiB of rows; the dense matrix would be "
        f"{fmt_bytes(t['classes'] ** 2 * 4)}), {t['cpus']} Ray CPUs"
    )
    print(
        f"  {r['tasks']} tasks of {r['block_rows']:,} query rows, stream blocks of {r['stream_rows']:,} rows "
        f"x {r['band_cols']:,} columns: {r['seconds']:.1f} s ({r['task_cpu_seconds']:.1f} CPU s in its tasks), "
        f"{fmt_bytes(r['read_bytes'])} read; "
        f"peak per task +{fmt_bytes(r['max_rss_added'])} (bound {fmt_bytes(r['bound_bytes'])}, "
        f"{fmt_bytes(r['max_rss_above_idle'])} above an idle worker); matrix written: {r['matrix_written']}"
    )
    same, base = t["same_c"]["topk"], t["same_c"]["numpy"]
    print(
        f"  at C = {t['numpy_classes']:,}: top-k route {same['seconds']:.1f} s, {same['task_cpu_seconds']:.1f} CPU s "
        f"(peak per task +{fmt_bytes(same['max_rss_added'])}); numpy in memory {base['seconds']:.1f} s, "
        f"{base['cpu_seconds']:.1f} CPU s (read "
        f"{base['read_s']:.1f}, X @ X.T {base['gram_s']:.1f}, argpartition {base['topk_s']:.1f}; peak "
        f"+{fmt_bytes(base['rss_added'])}); ratio {t['same_c']['ratio_to_numpy']:.2f}; "
        f"neighbours agreeing {100 * same['agree_with_numpy']:.2f}%"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: D = 256 and one block size; top-k 6,000 x 128"
    )
    parser.add_argument("--section", choices=["dense", "topk", "all"], default="all", help="what to run (default all)")
    parser.add_argument("--classes", type=int, default=10_000, help="dense: rows C (default 10,000)")
    parser.add_argument("--dim", type=int, help="dense: columns D (default 2,048; quick 256)")
    parser.add_argument("--blocks", type=int, nargs="+", help="dense: block_rows values to run")
    parser.add_argument("--topk-classes", type=int, help="top-k: rows C (default 100,000; quick 6,000)")
    parser.add_argument("--topk-dim", type=int, help="top-k: columns D (default 1,024; quick 128)")
    parser.add_argument("--numpy-classes", type=int, help="top-k: C of the numpy comparison (default 20,000)")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="Ray CPUs (and numpy's threads)")
    parser.add_argument("--dir", help="directory for the store (default: system temp)")
    parser.add_argument("--out", default=str(OUT), help="JSON output path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import ray

    C = args.classes
    D = args.dim or (256 if args.quick else 2048)
    blocks = args.blocks or ([512] if args.quick else [256, 512, 1024])
    workdir = Path(tempfile.mkdtemp(prefix="classgrad-bench-sim-", dir=args.dir))
    path = workdir / "store.zarr"
    dense = args.section in ("dense", "all")
    results: dict = {
        "classes": C,
        "dim": D,
        "top_k": args.top_k,
        "cpus": args.cpus,
        "store_mib": C * D * 4 / MIB,
        "similarity_mib": C * C * 4 / MIB,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "load_average": os.getloadavg(),
        },
        "runs": [],
    }
    try:
        if dense:
            results["build_s"] = build_store(path, C, D)
        ray.init(
            num_cpus=args.cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": "65536"}},
        )
        try:
            idle = idle_worker_rss(ray)
            results["idle_worker_rss"] = idle
            for block_rows in blocks if dense else []:
                # Interleaved: each Ray run is timed right after its own numpy baseline, so
                # drifts in machine load hit both.
                base = numpy_baseline(path, args.top_k)
                s = compute_similarity(str(path), top_k=args.top_k, block_rows=block_rows, dense=True)
                reports = s["task_reports"]
                run = {
                    "block_rows": block_rows,
                    "band_cols": s["band_cols"],
                    "tasks": s["tasks"],
                    "seconds": s["seconds"],
                    "read_bytes": s["read_bytes"],
                    "bound_bytes": s["memory_bound_bytes"],
                    "bound_parts": s["memory_bound_parts"],
                    "block_bytes": block_rows * s["band_cols"] * 4,
                    "strip_bytes": block_rows * C * 4,
                    "max_rss_added": max(r["rss_added"] for r in reports),
                    "max_rss_above_idle": max(r["rss_peak"] for r in reports) - idle,
                    "exact_peak": all(r["exact_peak"] for r in reports),
                    "task_seconds": [r["seconds"] for r in reports],
                }
                run["within_bound"] = run["max_rss_added"] <= run["bound_bytes"]
                run["numpy"] = base
                run["ratio_to_numpy"] = run["seconds"] / base["seconds"]
                results["runs"].append(run)
            if args.section in ("topk", "all"):
                results["topk"] = topk_section(args, workdir, idle)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"]["load_average_after"] = os.getloadavg()

    if dense:
        print_dense(results, args)
    if "topk" in results:
        print_topk(results["topk"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    ok = all(r["within_bound"] for r in results["runs"])
    if "topk" in results:
        ok = ok and results["topk"]["run"]["within_bound"] and results["topk"]["same_c"]["topk"]["within_bound"]
    return 0 if ok else 1


def print_dense(results: dict, args: argparse.Namespace) -> None:
    C, D = results["classes"], results["dim"]
    print(
        f"class similarity (cosine, top-{args.top_k}) of {C:,} x {D:,} float32 "
        f"({results['store_mib']:.0f} MiB of rows, {results['similarity_mib']:.0f} MiB "
        f"matrix), {args.cpus} Ray CPUs; idle worker RSS {fmt_bytes(results['idle_worker_rss'])}"
    )
    print(
        f"{'block rows':>10} {'tasks':>5} {'block':>9} {'strip':>9} {'bound/task':>10} "
        f"{'peak/task':>10} {'above idle':>10} {'ok':>3} {'ray s':>6} {'numpy s':>7} "
        f"{'numpy peak':>10} {'ratio':>5}"
    )
    for r in results["runs"]:
        n = r["numpy"]
        print(
            f"{r['block_rows']:>10} {r['tasks']:>5} {fmt_bytes(r['block_bytes']):>9} "
            f"{fmt_bytes(r['strip_bytes']):>9} {fmt_bytes(r['bound_bytes']):>10} "
            f"{fmt_bytes(r['max_rss_added']):>10} {fmt_bytes(r['max_rss_above_idle']):>10} "
            f"{'yes' if r['within_bound'] else 'NO':>3} {r['seconds']:>6.1f} "
            f"{n['seconds']:>7.1f} {fmt_bytes(n['rss_added']):>10} {r['ratio_to_numpy']:>5.2f}"
        )
    print(
        "ray s: the whole run (read blocks, products, top-k, write the matrix and table back); "
        "numpy s: one process, all in memory, no write; ratio = ray s / numpy s"
    )


if __name__ == "__main__":
    sys.exit(main())
