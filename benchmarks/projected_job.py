"""A projected job next to the same job unprojected, through Ray and the store (issue 8).

The same job (``zoo.small_cnn`` width 16 on 3x16x16 images, C classes, every parameter: D is
large enough that projecting saves most of the store) runs on a local Ray with 2 actors, once
storing full rows and once with ``projection.dim = k`` (Rademacher). Reported side by side:
total time (driver start to summary, Ray start-up excluded: Ray is started once before both),
per-row time, bytes written and store size. Runs alternate, best of ``--reps``.

    .venv/bin/python -m benchmarks.projected_job            # C = 4,000, k = 1,024, 2 reps
    .venv/bin/python -m benchmarks.projected_job --quick    # C = 1,000, 1 rep

Prints a table and writes ``benchmarks/out/projected_job.json``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt_s, print_table

OUT = common.OUT_DIR / "projected_job.json"


def job(classes: int, url: str, dim: int | None) -> dict[str, Any]:
    return {
        "model": {"factory": "classgrad.workers.zoo:small_cnn", "kwargs": {"num_classes": classes, "width": 16}},
        "data": {
            "factory": "classgrad.workers.zoo:synthetic_probe",
            "kwargs": {"num_classes": classes, "samples_per_class": 4, "input_shape": [3, 16, 16]},
        },
        "loss": {"num_classes": classes},
        "params": {"exclude": ["head.2.*"]},  # the last layer grows with C; the rest does not
        "sharding": {"shard_rows": 256},
        "store": {"url": url, "row_chunk": 64, "overwrite": True},
        "cluster": {"num_workers": 2, "num_cpus_per_worker": 1},
        "projection": {"dim": dim, "kind": "rademacher", "seed": 0},
        "run": {"progress": "none"},
    }


def run(config: dict) -> dict[str, Any]:
    from classgrad.service.config import JobConfig
    from classgrad.service.runtime.driver import JobDriver
    from classgrad.service.store import open_store

    t0 = time.perf_counter()
    summary = JobDriver(JobConfig.model_validate(config)).run()
    seconds = time.perf_counter() - t0
    store = open_store(config["store"]["url"])
    size = sum(p.stat().st_size for p in Path(config["store"]["url"]).rglob("*") if p.is_file())
    return {
        "seconds": seconds,
        "rows": summary.rows,
        "bytes_written": summary.bytes,
        "store_bytes": size,
        "dim": store.dim,
        "complete": bool(store.is_complete),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--classes", type=int)
    parser.add_argument("--dim", type=int, default=1024, help="projection dimension k")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    classes = args.classes or (1000 if args.quick else 4000)
    reps = args.reps or (1 if args.quick else 2)
    logging.basicConfig(level=logging.WARNING)

    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray_start = time.perf_counter() - t0
    workdir = Path(tempfile.mkdtemp(prefix="classgrad-projected-"))
    results: dict[str, list[dict]] = {"full rows": [], f"projected, k = {args.dim}": []}
    try:
        for rep in range(reps):
            for name, dim in (("full rows", None), (f"projected, k = {args.dim}", args.dim)):
                url = str(workdir / f"{'p' if dim else 'f'}{rep}.zarr")
                results[name].append(run(job(classes, url, dim)))
                shutil.rmtree(url, ignore_errors=True)
                print(f"rep {rep + 1}: {name}: {fmt_s(results[name][-1]['seconds'])}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)

    best = {name: min(runs, key=lambda r: r["seconds"]) for name, runs in results.items()}
    base = best["full rows"]["seconds"]
    rows = [
        [
            name,
            r["dim"],
            fmt_s(r["seconds"]),
            f"{1e6 * r['seconds'] / classes:.0f} us",
            f"{r['seconds'] / base:.2f}x",
            f"{r['store_bytes'] / 2**20:.1f} MiB",
            r["complete"],
        ]
        for name, r in best.items()
    ]
    print(
        f"\n== projected vs full rows: small_cnn width 16, C = {classes:,}, 2 actors, best of {reps} "
        f"(Ray start-up {fmt_s(ray_start)} excluded)"
    )
    print_table(["job", "stored dim", "total time", "per row", "vs full", "store size", "complete"], rows)
    common.write_report(
        args.out,
        {
            "machine": common.machine_info(),
            "classes": classes,
            "dim": args.dim,
            "ray_start_seconds": ray_start,
            "runs": results,
            "best": best,
        },
    )


if __name__ == "__main__":
    main()
