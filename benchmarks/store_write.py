"""Write throughput of the gradient store on local disk, next to ``numpy.tofile`` of the same
bytes in the same run.

For each chunk shape (row_chunk x col_chunk) and sharding on/off, a fresh store is filled the
way workers fill it (one ``write_rows`` per work shard, then ``mark_shard_done``); the raw
baseline writes the same stored bytes with one ``ndarray.tofile``. Raw and store runs are
interleaved and repeated; medians are reported. Store creation (metadata only) is not timed.

Two times are taken for every write: until the writes return (the data is in the page
cache; this measures CPU overhead against a plain memory copy) and until a following
``os.sync()`` returns (the data is on the disk). "Throughput on local disk" is the second;
the goal, the best chunk shape reaching >= 70% of raw, is judged on it. Both are printed.

    .venv/bin/python -m benchmarks.store_write            # ~256 MiB per write, 5 reps
    .venv/bin/python -m benchmarks.store_write --quick    # ~32 MiB, 3 reps
    .venv/bin/python -m benchmarks.store_write --quick --fsync-only   # the cost of durability alone

Stores fsync their chunk files, directories and shard record before each ``shard_done`` mark
(``GradStore.durable``, issue 15); rows marked "fsync no" turn that off, to measure its cost.

Prints a table and writes ``benchmarks/out/store_write.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from classgrad.store import StoreSpec, create_store

GOAL = 0.70
OUT = Path(__file__).resolve().parent / "out" / "store_write.json"


def stored_bytes(rows: np.ndarray, dtype: str) -> np.ndarray:
    """The array the raw baseline writes: the same number of bytes the store holds."""
    if dtype == "float32":
        return rows
    if dtype == "float16":
        return rows.astype(np.float16)
    return (rows.view(np.uint32) >> 16).astype(np.uint16)


def timed(write) -> tuple[float, float]:
    """(seconds until ``write`` returns, seconds until the data is on disk)."""
    os.sync()  # start from a clean page cache so earlier writes are not billed here
    start = time.perf_counter()
    write()
    cached = time.perf_counter() - start
    os.sync()
    return cached, time.perf_counter() - start


def time_raw(data: np.ndarray, workdir: Path) -> tuple[float, float]:
    path = workdir / "raw.bin"
    times = timed(lambda: data.tofile(path))
    path.unlink()
    return times


def time_store(
    rows: np.ndarray,
    workdir: Path,
    *,
    dtype: str,
    shard_rows: int,
    row_chunk: int,
    col_chunk: int,
    sharded: bool,
    durable: bool = True,
) -> tuple[float, float]:
    path = workdir / "store.zarr"
    spec = StoreSpec(
        num_classes=rows.shape[0],
        dim=rows.shape[1],
        shard_rows=shard_rows,
        row_chunk=row_chunk,
        col_chunk=col_chunk,
        dtype=dtype,
        sharded=sharded,
    )
    store = create_store(str(path), spec)
    store.durable = durable
    zeros = np.zeros(shard_rows, dtype=np.float32)

    def write() -> None:
        for shard in range(store.num_shards):
            a, b = store.shard_range(shard)
            store.write_rows(a, rows[a:b], loss=zeros[: b - a], count=zeros[: b - a])
            store.mark_shard_done(shard)

    times = timed(write)
    shutil.rmtree(path)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    parser.add_argument("--classes", type=int, help="rows C (default 512, quick 128)")
    parser.add_argument("--dim", type=int, help="columns D (default 131072, quick 65536)")
    parser.add_argument("--reps", type=int, help="repetitions (default 5, quick 3)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--shard-rows", type=int, default=128, help="rows per work shard")
    parser.add_argument("--fsync-only", action="store_true", help="only the with/without fsync comparison")
    parser.add_argument("--dir", help="directory on the disk to measure (default: system temp)")
    parser.add_argument("--out", default=str(OUT), help="JSON output path")
    args = parser.parse_args(argv)

    C = args.classes or (128 if args.quick else 512)
    D = args.dim or (65536 if args.quick else 131072)
    reps = args.reps or (3 if args.quick else 5)
    fsync_pairs = [(16, 16384, False, True), (16, 16384, False, False), (64, D, False, True), (64, D, False, False)]
    shapes = (  # (row_chunk, col_chunk, sharded, durable)
        fsync_pairs
        if args.fsync_only
        else [(16, 16384, False, True), (16, D, False, True), (64, D, False, True), (16, 16384, True, True)]
        + [(16, D, True, True), (16, 16384, False, False), (64, D, False, False)]
    )
    rows = np.random.default_rng(0).standard_normal((C, D), dtype=np.float32)
    raw_data = stored_bytes(rows, args.dtype)
    mib = raw_data.nbytes / 2**20

    workdir = Path(tempfile.mkdtemp(prefix="classgrad-bench-", dir=args.dir))
    raw_times: list[tuple[float, float]] = []
    store_times: dict[tuple, list[tuple[float, float]]] = {shape: [] for shape in shapes}
    try:
        time_raw(raw_data, workdir)  # warm-up: file system and allocator
        for _ in range(reps):
            # Interleaved, so drifts in disk speed hit raw and store alike.
            raw_times.append(time_raw(raw_data, workdir))
            for shape in shapes:
                row_chunk, col_chunk, sharded, durable = shape
                store_times[shape].append(
                    time_store(
                        rows,
                        workdir,
                        dtype=args.dtype,
                        shard_rows=args.shard_rows,
                        row_chunk=row_chunk,
                        col_chunk=col_chunk,
                        sharded=sharded,
                        durable=durable,
                    )
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def summary(times: list[tuple[float, float]]) -> dict:
        cached = statistics.median(t[0] for t in times)
        disk = statistics.median(t[1] for t in times)
        return {
            "seconds": times,
            "cached_median_s": cached,
            "disk_median_s": disk,
            "cached_mib_per_s": mib / cached,
            "disk_mib_per_s": mib / disk,
        }

    raw = summary(raw_times)
    results = []
    for (row_chunk, col_chunk, sharded, durable), times in store_times.items():
        r = {
            "row_chunk": row_chunk,
            "col_chunk": col_chunk,
            "sharded": sharded,
            "fsync": durable,
            "chunk_mib": row_chunk * col_chunk * raw_data.itemsize / 2**20,
            **summary(times),
        }
        r["cached_ratio"] = raw["cached_median_s"] / r["cached_median_s"]
        r["disk_ratio"] = raw["disk_median_s"] / r["disk_median_s"]
        results.append(r)
    best = max((r for r in results if r["fsync"]), key=lambda r: r["disk_ratio"])
    met = best["disk_ratio"] >= GOAL

    print(
        f"store write vs numpy.tofile: {C} x {D} {args.dtype} ({mib:.0f} MiB), "
        f"shard_rows {args.shard_rows}, median of {reps}, cpus {os.cpu_count()}"
    )
    print(f"{'':>27} {'':>15} | {'to disk (incl. sync)':>20} | {'page cache only':>16}")
    print(
        f"{'row_chunk':>9} {'col_chunk':>9} {'sharded':>7} {'fsync':>5} {'chunk MiB':>9} | "
        f"{'MiB/s':>10} {'of raw':>9} | {'MiB/s':>7} {'of raw':>8}"
    )
    print(
        f"{'raw':>9} {'':>9} {'':>7} {'':>5} {'':>9} | {raw['disk_mib_per_s']:10.0f} {1:9.0%} | "
        f"{raw['cached_mib_per_s']:7.0f} {1:8.0%}"
    )
    for r in results:
        print(
            f"{r['row_chunk']:>9} {r['col_chunk']:>9} {str(r['sharded']):>7} {'yes' if r['fsync'] else 'no':>5} "
            f"{r['chunk_mib']:9.2f} | {r['disk_mib_per_s']:10.0f} {r['disk_ratio']:9.0%} | "
            f"{r['cached_mib_per_s']:7.0f} {r['cached_ratio']:8.0%}"
        )
    print(
        f"best: row_chunk {best['row_chunk']} x col_chunk {best['col_chunk']}"
        f"{' sharded' if best['sharded'] else ''}: {best['disk_ratio']:.0%} of raw to disk "
        f"({best['cached_ratio']:.0%} to page cache); goal >= {GOAL:.0%} to disk "
        f"{'met' if met else 'NOT met'}"
    )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "store_write",
                "params": {
                    "classes": C,
                    "dim": D,
                    "dtype": args.dtype,
                    "reps": reps,
                    "shard_rows": args.shard_rows,
                    "mib": mib,
                    "quick": args.quick,
                    "fsync_only": args.fsync_only,
                },
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "numpy": np.__version__,
                },
                "raw": raw,
                "results": results,
                "best": best,
                "goal": GOAL,
                "goal_met": met,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
