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

    .venv/bin/python -m benchmarks.similarity            # 10,000 x 2,048; blocks 256/512/1024
    .venv/bin/python -m benchmarks.similarity --quick    # 10,000 x 256; block 512

Prints a table and writes ``benchmarks/out/similarity.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from classgrad.service.analysis import fmt_bytes
from classgrad.service.analysis.similarity import PeakMemory, compute_similarity, top_k_rows
from classgrad.service.store import StoreSpec, create_store, open_store

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
        import classgrad.service.store  # noqa: F401
        from classgrad.service.analysis.similarity import _rss

        return _rss()

    return max(ray.get([probe.remote() for _ in range(4)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D = 256 and one block size")
    parser.add_argument("--classes", type=int, default=10_000, help="rows C (default 10,000)")
    parser.add_argument("--dim", type=int, help="columns D (default 2,048; quick 256)")
    parser.add_argument("--blocks", type=int, nargs="+", help="block_rows values to run")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="Ray CPUs")
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
        },
        "runs": [],
    }
    try:
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
            for block_rows in blocks:
                # Interleaved: each Ray run is timed right after its own numpy baseline, so
                # drifts in machine load hit both.
                base = numpy_baseline(path, args.top_k)
                s = compute_similarity(str(path), top_k=args.top_k, block_rows=block_rows)
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
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["within_bound"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
