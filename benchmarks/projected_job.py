"""A projected job next to the same job unprojected, through Ray and the store (issue 8).

The same job (``zoo.small_cnn`` width 16 on 3x16x16 images, C classes, every parameter: D is
large enough that projecting saves most of the store) runs on a local Ray with 2 actors, once
storing full rows and once with ``projection.dim = k`` (Rademacher). Reported side by side:
total time (driver start to summary, Ray start-up excluded: Ray is started once before both),
per-row time, bytes written and store size. Runs alternate, best of ``--reps``.

    .venv/bin/python -m benchmarks.projected_job            # C = 4,000, k = 1,024, 2 reps
    .venv/bin/python -m benchmarks.projected_job --quick    # C = 1,000, 1 rep

``--model vit`` (issue 18) compares, per row, each projection structure with the unprojected
engine and with the floor on a Hugging Face ViT (hidden 192, 6 layers, D >= 2.7M, every
parameter), classes of 1
to 4 samples, one worker in one thread, no Ray: each measurement in its own process (its peak
RSS is reported). ``floor``: one forward+backward over the probe set in the engine's batches;
``engine``: the unprojected engine's rows (not stored); ``dense`` / ``kronecker`` / ``sketch``
(whole finished rows by the sparse sign sketch): the job's real worker writing the projected
rows into a real store (compute only: the driver's
preparation, which for ``kronecker`` measures the split on the first 32 classes, is reported
apart). ``floor + write`` adds the kronecker job's own write time to the floor.

    .venv/bin/python -m benchmarks.projected_job --model vit --classes 1000 --dim 4096
    .venv/bin/python -m benchmarks.projected_job --model vit --rest dense sketch   # both rests
    .venv/bin/python -m benchmarks.projected_job --model vit --quick   # C = 200, k = 1,024
    .venv/bin/python -m benchmarks.projected_job --model vit --device cuda   # the same on a GPU

Prints a table and writes ``benchmarks/out/projected_job.json`` (``projected_vit.json``).
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
    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.driver import JobDriver
    from classgrad.store import open_store

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


def vit_job(
    classes: int, url: str, projection: dict[str, Any], hidden: int = 192, device: str = "cpu"
) -> dict[str, Any]:
    kwargs = {"num_classes": classes, "hidden": hidden, "intermediate": 4 * hidden}
    return {
        "engine": {"device": device},
        "model": {"factory": "benchmarks.hf_models:vit", "kwargs": kwargs},
        "data": {
            "factory": "classgrad.workers.zoo:synthetic_probe",
            # Zipf-like sizes around 2: 1 to 4 samples per class (a few get more).
            "kwargs": {"num_classes": classes, "samples_per_class": 2, "imbalance": 0.3, "input_shape": [3, 32, 32]},
            "batch_size": 64,
        },
        "loss": {"num_classes": classes},
        "sharding": {"shard_rows": 64},
        "store": {"url": url, "row_chunk": 64, "overwrite": True},
        "cluster": {"num_workers": 1, "num_cpus_per_worker": 1},
        "projection": projection,
        "run": {"progress": "none"},
    }


def measure_one(
    what: str,
    classes: int,
    dim: int,
    workdir: str,
    max_rows: int | None = None,
    low_rank: str = "dense",
    hidden: int = 192,
    rest: str = "dense",
    sketch_nonzeros: int = 4,
    device: str = "cpu",
) -> dict[str, Any]:
    """One measurement of ``--model vit`` in this process (threads: 1). ``prepare-S``: the
    driver's preparation of structure S's store; ``S``: its worker on the first ``max_rows``
    rows (whole shards; all when None)."""
    prepare_only = what.startswith("prepare-")
    what = what.removeprefix("prepare-")
    import resource

    import torch

    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import prepare_store
    from classgrad.workers.actor_runtime.actor import GradientWorker
    from classgrad.workers.actor_runtime.factory import build_job_engine

    torch.set_num_threads(1)
    proj: dict[str, Any] = {"dim": None}
    if what in ("dense", "kronecker", "sketch"):
        proj = {"dim": dim, "seed": 0, "structure": what}
        if what == "kronecker":
            proj.update(low_rank=low_rank, rest=rest, sketch_nonzeros=sketch_nonzeros)
        if what == "sketch":
            proj.update(sketch_nonzeros=sketch_nonzeros)
    config = JobConfig.model_validate(vit_job(classes, str(Path(workdir) / f"{what}.zarr"), proj, hidden, device))
    out: dict[str, Any] = {"what": what, "rows": classes}
    if what in ("floor", "engine"):
        engine = build_job_engine(config, device=device)
        out["dim_in"] = engine.layout.dim
        t0 = time.perf_counter()
        if what == "engine":
            for _ in engine.iter_blocks(range(classes)):
                pass
        else:
            probe, loss = engine.probe, engine.loss
            with engine.selected_grads():
                for idx in torch.arange(len(probe)).split(probe.batch_size):
                    x, y = probe.batch(idx, engine.device, engine.compute_dtype)
                    value = loss.sample_losses(engine.io(x), loss.labels(y)).sum()
                    torch.autograd.grad(value, engine.params)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        out["seconds"] = time.perf_counter() - t0
    elif prepare_only:  # the driver's side, in its own process (its memory is not the worker's)
        t0 = time.perf_counter()
        prepare_store(config)
        out["seconds"] = time.perf_counter() - t0
    else:
        worker = GradientWorker(config.model_dump(mode="json"), num_threads=1)
        shards = range(worker.store.num_shards)[: -(-(max_rows or classes) // 64)]
        reports = [worker.compute_shard(shard) for shard in shards]
        out["rows"] = sum(r["rows"] for r in reports)
        out["seconds"] = sum(r["seconds"] for r in reports)
        out["write_seconds"] = sum(r["write_seconds"] for r in reports)
        out["stored_dim"] = worker.store.dim
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main_vit(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    classes = args.classes or (200 if args.quick else 1000)
    dim = args.dim if args.dim != 1024 or args.quick else 4096
    workdir = Path(tempfile.mkdtemp(prefix="classgrad-projected-vit-"))
    results: dict[str, dict] = {}
    try:
        steps = [("floor", None), ("engine", None)]
        for rest in args.rest:  # one kronecker job per rest mode
            steps += [("prepare-kronecker", rest), ("kronecker", rest)]
        steps += [("prepare-sketch", None), ("sketch", None)]  # whole finished rows sketched
        steps += [("prepare-dense", None), ("dense", None)]
        for what, rest in steps:
            if what.endswith("dense") and not args.dense_rows:
                continue
            cmd = [sys.executable, "-m", "benchmarks.projected_job", "--one", what, "--classes", str(classes)]
            cmd += ["--dim", str(dim), "--workdir", str(workdir), "--hidden", str(args.hidden), "--device", args.device]
            if what.endswith("kronecker"):
                cmd += ["--low-rank", args.low_rank, "--rest", str(rest)]
            if what.endswith(("kronecker", "sketch")):
                cmd += ["--sketch-nonzeros", str(args.sketch_nonzeros)]
            if what == "dense":
                cmd += ["--max-rows", str(args.dense_rows)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            name = what.removeprefix("prepare-") + (f" (rest {rest})" if rest else "")
            if what.startswith("prepare-"):
                results[name] = {"prepare_seconds": r["seconds"]}
            else:
                results[name] = {**results.get(name, {}), **r}
            print(f"{name}: {fmt_s(r['seconds'])} ({r['rows']} rows)", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    floor = results["floor"]["seconds"]
    kron = results[f"kronecker (rest {args.rest[0]})"]
    write = kron.get("write_seconds", 0.0)
    table = []
    floor_row = floor / classes
    per_row = {what: r["seconds"] / r["rows"] for what, r in results.items()}
    per_row["floor + write"] = floor_row + write / kron["rows"]
    engine_row = per_row["engine"]
    for what, r in [*results.items(), ("floor + write", {"rows": classes})]:
        table.append(
            [
                what,
                r.get("stored_dim", results["floor"]["dim_in"] if what in ("floor", "engine") else "-"),
                r["rows"],
                f"{1e3 * per_row[what]:.1f} ms",
                f"{per_row[what] / floor_row:.2f}x",
                f"{per_row[what] / engine_row:.2f}x",
                fmt_s(r["prepare_seconds"]) if "prepare_seconds" in r else "-",
                f"{r['peak_rss_mib']:.0f} MiB" if "peak_rss_mib" in r else "-",
            ]
        )
    print(
        f"\n== ViT hidden {args.hidden} (D = {results['floor']['dim_in']:,}), C = {classes:,}, k = {dim:,}, "
        f"low_rank {args.low_rank}, sketch_nonzeros {args.sketch_nonzeros} (rest sketch), {args.device}, "
        "1 thread, no Ray"
    )
    headers = ["rows", "stored dim", "rows timed", "per row", "vs floor", "vs engine", "preparation", "peak RSS"]
    print_table(headers, table)
    out = args.out if args.out != str(OUT) else str(common.OUT_DIR / "projected_vit.json")
    common.write_report(out, {"machine": common.machine_info(), "classes": classes, "dim": dim, "results": results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--classes", type=int)
    parser.add_argument("--dim", type=int, default=1024, help="projection dimension k")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--model", choices=["cnn", "vit"], default="cnn", help="vit: per structure, issue 18")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # --model vit: one measurement, JSON on stdout
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--max-rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--low-rank", choices=["dense", "kronecker"], default="dense", help="vit: projection.low_rank")
    parser.add_argument(
        "--dense-rows", type=int, default=256, help="vit: time the dense job on its first N rows only (0: skip it)"
    )
    parser.add_argument("--hidden", type=int, default=192, help="vit: hidden size (intermediate 4x)")
    parser.add_argument(
        "--rest",
        nargs="+",
        default=["sketch"],
        choices=["dense", "keep", "sketch"],
        help="vit: projection.rest (one kronecker job each; default the config's, sketch)",
    )
    parser.add_argument("--sketch-nonzeros", type=int, default=4, help="vit: projection.sketch_nonzeros")
    parser.add_argument("--device", default="cpu", help="vit: engine.device (cuda: the issue's GPU comparison)")
    args = parser.parse_args()
    if args.one:
        logging.basicConfig(level=logging.WARNING)
        found = measure_one(
            args.one,
            args.classes,
            args.dim,
            args.workdir,
            args.max_rows,
            args.low_rank,
            args.hidden,
            args.rest[0],
            args.sketch_nonzeros,
            args.device,
        )
        print(json.dumps(found))
        return
    if args.model == "vit":
        main_vit(args)
        return
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
