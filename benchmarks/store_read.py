"""Read throughput of the gradient store with and without the digest check on read (issue 45).

Every reader checks each chunk object of a done shard against the blake2b digest its shard's
record holds (``classgrad.store.integrity.verified``). This measures what that costs: a store of
``C x D`` float32 rows per chunk shape (row_chunk x col_chunk, and Zarr-sharded), read whole
block by block as ``similarity``, ``score`` and ``aggregate`` read it (``iter_blocks``), with the
check on and off (``GradStore.check_digests``), interleaved, best of ``--reps`` (on this VM the
same read moves by up to 2x between runs; the best is the cost, the rest is the neighbours'); the
files are in the page cache (read once before timing), so the figure is the CPU cost, the worst
case for the check's share. Target: the check costs at most 5% of read throughput.

    .venv/bin/python -m benchmarks.store_read            # 1,024 x 65,536 (256 MiB), 9 reps
    .venv/bin/python -m benchmarks.store_read --quick    # 256 x 32,768 (32 MiB), 3 reps

Prints a table, asserts nothing; writes ``benchmarks/out/store_read.json``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from classgrad.store import StoreSpec, create_store, open_store

OUT = common.OUT_DIR / "store_read.json"
TARGET = 0.05
SHAPES = ((16, 16384, False), (64, 0, False), (16, 16384, True))  # col_chunk 0: the whole row


def make_store(path: Path, rows: np.ndarray, row_chunk: int, col_chunk: int, sharded: bool, shard_rows: int) -> str:
    C, D = rows.shape
    spec = StoreSpec(
        num_classes=C,
        dim=D,
        shard_rows=shard_rows,
        row_chunk=row_chunk,
        col_chunk=col_chunk or D,
        sharded=sharded,
        fingerprint="bench",
    )
    store = create_store(str(path), spec)
    store.durable = False
    for shard in range(store.num_shards):
        a, b = store.shard_range(shard)
        store.write_rows(a, rows[a:b], loss=np.zeros(b - a), count=np.ones(b - a))
        store.mark_shard_done(shard)
    return str(path)


def read_all(url: str, check: bool, block_rows: int) -> float:
    store = open_store(url)
    store.check_digests = check
    t0 = time.perf_counter()
    for _ in store.iter_blocks(block_rows):
        pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", type=int, help="rows (default 1,024; quick 256)")
    ap.add_argument("--dim", type=int, help="columns (default 65,536; quick 32,768)")
    ap.add_argument("--reps", type=int, help="repetitions (default 9; quick 3)")
    ap.add_argument("--shard-rows", type=int, default=128)
    ap.add_argument("--block-rows", type=int, default=256, help="rows per read")
    ap.add_argument("--dir", help="directory on the disk to use (default: system temp)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    C = args.classes or (256 if args.quick else 1024)
    D = args.dim or (32768 if args.quick else 65536)
    reps = args.reps or (3 if args.quick else 9)
    rows = np.random.default_rng(0).standard_normal((C, D), dtype=np.float32)
    mib = rows.nbytes / 2**20
    workdir = Path(tempfile.mkdtemp(prefix="classgrad-read-", dir=args.dir))
    results = []
    try:
        for i, (row_chunk, col_chunk, sharded) in enumerate(SHAPES):
            url = make_store(workdir / f"s{i}.zarr", rows, row_chunk, col_chunk, sharded, args.shard_rows)
            read_all(url, True, args.block_rows)  # page cache and first-use costs
            on, off = [], []
            for _ in range(reps):  # interleaved: a drift of the VM hits both alike
                on.append(read_all(url, True, args.block_rows))
                off.append(read_all(url, False, args.block_rows))
            t_on, t_off = min(on), min(off)
            results.append({
                "row_chunk": row_chunk, "col_chunk": col_chunk or D, "sharded": sharded,
                "checked_s": on, "unchecked_s": off, "checked_mib_s": mib / t_on, "unchecked_mib_s": mib / t_off,
                "cost": t_on / t_off - 1,
            })  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"store reads, {C} x {D} float32 ({mib:.0f} MiB), blocks of {args.block_rows} rows, best of {reps}")
    common.print_table(
        ["row_chunk", "col_chunk", "sharded", "checked MiB/s", "unchecked MiB/s", "cost of the check", "target"],
        [
            [r["row_chunk"], r["col_chunk"], r["sharded"], f"{r['checked_mib_s']:.0f}", f"{r['unchecked_mib_s']:.0f}",
             f"{100 * r['cost']:+.1f}%", "met" if r["cost"] <= TARGET else "MISSED"]
            for r in results
        ],
    )  # fmt: skip
    common.write_report(OUT, {"machine": common.machine_info(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
