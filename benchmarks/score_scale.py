"""``classgrad score`` at scale, from generated rows (no model): Q queries against C classes at
k columns, top-10 per query, with memory per task bounded and no Q x C array.

A store of C x k float32 rows (default 100,000 x 4,096 = 1.5 GiB, a projected store's shape) is
generated under ``--dir`` (kept for reruns with ``--keep``), and Q x k query rows (default 10,000)
in memory. ``score_rows`` then computes each query's top-10 classes (``--method``, default dot)
as Ray tasks on a local Ray (``--executor local``: in this process), without ``--out``: the
driver only gathers the Q x 10 tables. Each task reports its peak resident memory above its
start (Linux: the kernel's high-water mark); the bound is ``ScorePlan.memory_bound()``. A
sample of queries is checked against a float64 brute force over every row.

    .venv/bin/python -m benchmarks.score_scale                          # Q 10,000 x C 100,000 x k 4,096
    .venv/bin/python -m benchmarks.score_scale --queries 1000 --classes 20000 --dim 1024   # smaller
    .venv/bin/python -m benchmarks.score_scale --quick                  # 500 x 5,000 x 256

Prints one summary and writes ``benchmarks/out/score_scale.json``. Timings on a shared machine
are noisy: the CPU seconds of the tasks are reported beside the wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from classgrad.service.analysis import fmt_bytes
from classgrad.service.analysis.memory import PeakMemory
from classgrad.service.analysis.score_driver import score_rows
from classgrad.store import StoreSpec, create_store, open_store

OUT = Path(__file__).resolve().parent / "out" / "score_scale.json"
MIB = 1 << 20


def build_store(path: Path, C: int, D: int, shard_rows: int = 4096) -> float:
    """C x D rows with some structure (100 directions shared by groups of classes), written shard by shard."""
    t0 = time.perf_counter()
    store = create_store(
        str(path),
        StoreSpec(
            num_classes=C,
            dim=D,
            shard_rows=shard_rows,
            row_chunk=256,
            col_chunk=D,
            dtype="float32",
            projection={"kind": "rademacher", "dim": D, "seed": 0, "out_dim": D},
            fingerprint=f"scale-{C}x{D}",
            loss_kind="cross_entropy",
        ),
    )
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((100, D)).astype(np.float32)
    for shard in range(store.num_shards):
        a, b = store.shard_range(shard)
        rows = rng.standard_normal((b - a, D), dtype=np.float32)
        rows += 0.5 * directions[rng.integers(0, 100, b - a)]
        store.write_rows(a, rows, loss=np.ones(b - a), count=np.ones(b - a, dtype=np.int64))
        store.mark_shard_done(shard)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 queries x 5,000 classes x 256")
    parser.add_argument("--queries", type=int, help="Q (default 10,000)")
    parser.add_argument("--classes", type=int, help="C (default 100,000)")
    parser.add_argument("--dim", type=int, help="k (default 4,096)")
    parser.add_argument("--method", choices=["dot", "cosine", "trak"], default="dot")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--task-mb", type=float, default=768.0, help="memory budget of one task (default 768)")
    parser.add_argument("--executor", choices=["ray", "local"], default="ray")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="Ray CPUs")
    parser.add_argument("--check", type=int, default=20, help="queries checked against a float64 brute force")
    parser.add_argument("--dir", help="directory for the store (default: system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the store (and reuse one of the same size)")
    parser.add_argument("--out", default=str(OUT), help="JSON output path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    Q = args.queries or (500 if args.quick else 10_000)
    C = args.classes or (5_000 if args.quick else 100_000)
    D = args.dim or (256 if args.quick else 4096)
    root = Path(args.dir or tempfile.gettempdir())
    path = root / f"classgrad-score-scale-{C}x{D}.zarr"
    build_s = None
    if not (args.keep and path.exists()):
        shutil.rmtree(path, ignore_errors=True)
        build_s = build_store(path, C, D)
    store = open_store(str(path), mode="r+")
    queries = np.random.default_rng(1).standard_normal((Q, D), dtype=np.float32)
    driver = PeakMemory()
    session = None
    if args.executor == "ray":
        import ray

        ray.init(
            num_cpus=args.cpus,
            include_dashboard=False,
            runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": "65536"}},
        )
        session = ray
    try:
        t0 = time.perf_counter()
        result = score_rows(
            [store], [queries], method=args.method, top_k=args.top_k, executor=args.executor, task_mb=args.task_mb
        )
        seconds = time.perf_counter() - t0
    finally:
        driver_peak = driver.close()
        if session is not None:
            session.shutdown()
    info = result.info
    # A sample of queries against a float64 brute force over every row (read in blocks).
    sample = np.linspace(0, Q - 1, min(args.check, Q)).astype(int)
    q = queries[sample].astype(np.float64)
    if args.method == "cosine":
        q /= np.linalg.norm(q, axis=1)[:, None]
    if args.method == "trak":  # the saved Gram matrix is checked here by its own checksum
        gram, attrs = store.preconditioner.load(form="features")
        q = np.linalg.solve(gram + info["damping"][0] * np.eye(D), q.T).T
    exact = np.empty((len(sample), C))
    for a in range(0, C, 8192):
        block = store.block(a, min(a + 8192, C), (0, D)).astype(np.float64)
        if args.method == "cosine":
            block /= np.maximum(np.linalg.norm(block, axis=1), 1e-300)[:, None]
        exact[:, a : a + len(block)] = q @ block.T
    best = -np.sort(-exact, axis=1)[:, : args.top_k]
    err = float(np.abs(result.scores.numpy()[sample] - best).max() / np.abs(exact).max())
    report = {
        "method": args.method,
        "queries": Q,
        "classes": C,
        "dim": D,
        "store_bytes": C * D * 4,
        "build_s": build_s,
        "check_max_rel_err": err,
        "preconditioner": None if args.method != "trak" else store.preconditioner.info(),
        "driver_rss_added_bytes": driver_peak - driver.start,
        "load_average": os.getloadavg(),
        **{k: v for k, v in info.items() if k not in ("stores", "method")},
        "seconds": seconds,  # the whole call (trak: the Gram matrix included); the tasks' part: score_seconds
        "score_seconds": info["seconds"],
    }
    print(
        f"score {args.method}: {Q:,} queries x {C:,} classes x {D:,} (store {fmt_bytes(C * D * 4)}) in "
        f"{seconds:.1f} s ({args.executor}, {info['tasks']} tasks of <= {info['block_rows']} queries, class "
        f"blocks of {info['stream_rows']}); peak per task +{fmt_bytes(info['peak_task_rss_added_bytes'])} "
        f"(bound {fmt_bytes(info['memory_bound_bytes'])}); driver +{fmt_bytes(report['driver_rss_added_bytes'])}; "
        f"top-{args.top_k} of {len(sample)} queries vs float64: max error {err:.1e} of the largest score"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
