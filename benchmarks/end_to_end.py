"""The whole job through Ray and the store, next to the engine alone (issue 6).

1. **Job vs engine alone.** One job (the MLP of ``classgrad.workers.zoo``, ``--classes`` C with
   ``--spc`` samples each, rows = the second hidden layer's gradients so the store stays a
   few hundred MB) runs through ``classgrad.service.driver_runtime.driver.JobDriver`` on a local Ray with 1 actor, and
   again with 2 actors (one CPU and one torch thread each). The same engine computes the same
   rows in this process without Ray or a store ("engine alone", one torch thread). Per-row time
   of the job = (time from "actors ready" to "last shard done") / C: Ray start-up
   (``ray.init``), the driver's preflight and store creation, and actor start-up are measured
   and reported separately, not in the per-row time. The store is then checked: complete
   (every shard done, every row present) and a sample of rows equal to the engine's
   (``allclose``): writes are not skipped, they overlap compute on the ShardWriter thread.
   Engine-alone, 1-actor and 2-actor runs alternate, ``--reps`` each; best times are the
   figures. The CPU time of the actor processes (compute, writer thread, Ray) is reported
   next to the engine's own CPU time: on a loaded machine wall times swing, CPU times much less.
   Goals: 1 actor within 15% of the engine alone; 2 actors >= 1.7x faster than 1.
2. **Actor memory vs C.** A ``GradientWorker`` (the actor's class, used without Ray) computes
   and writes every shard of the same job at C = 1,000 and C = 10,000 (``--rss-classes``), each
   in a fresh subprocess; its peak RSS (``ru_maxrss``) is reported. Goal: ratio <= 1.1.

Both goals need a quiet machine: the load average is printed before and after (this is a
shared 2-core machine; with other work on the cores, 2 actors cannot reach 2x).

    .venv/bin/python -m benchmarks.end_to_end            # C = 10,000, 3 repetitions
    .venv/bin/python -m benchmarks.end_to_end --quick    # C = 4,000, 1 repetition

Prints tables and writes ``benchmarks/out/end_to_end.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import common
from benchmarks.common import fmt_s, loadavg, print_table

OUT = common.OUT_DIR / "end_to_end.json"


MODEL = "mlp"  # set from --model: "mlp" (rows are wide, writing is most of the work) or "cnn"


def job_config(classes: int, spc: int, hidden: int, url: str, workers: int, shard_rows: int) -> dict[str, Any]:
    if MODEL == "cnn":
        # The benchmark CNN (zoo.small_cnn, width 8, 3x16x16 images); rows = the two convolutions
        # and the first head layer (D = 2,448): compute-bound, like most real models.
        model = {"factory": "classgrad.workers.zoo:small_cnn", "kwargs": {"num_classes": classes, "width": 8}}
        data = {"kind": "image", "input_shape": [3, 16, 16]}
        params = ["features.*", "head.0.*"]
    else:
        model = {
            "factory": "classgrad.workers.zoo:mlp",
            "kwargs": {"num_classes": classes, "in_features": 32, "hidden": hidden, "depth": 2},
        }
        data = {"kind": "vector", "input_shape": [32]}
        params = ["2.*"]
    return {
        "model": model,
        "data": {
            "factory": "classgrad.workers.zoo:synthetic_probe",
            "kwargs": {"num_classes": classes, "samples_per_class": spc, "seed": 0, **data},
            "batch_size": 256,
        },
        "loss": {"kind": "cross_entropy", "num_classes": classes},
        "params": {"include": params},
        "sharding": {"shard_rows": shard_rows},
        "store": {"url": url, "row_chunk": 64, "overwrite": True},
        "cluster": {"num_workers": workers, "num_cpus_per_worker": 1},
        "run": {"progress": "none"},
    }


def engine_alone(config_dict: dict, sample_ids: list[int]) -> dict[str, Any]:
    """Every row computed by the job's engine in this process (one thread), blocks discarded
    except a few sample rows kept for the store check."""
    from classgrad.config import JobConfig
    from classgrad.workers.actor_runtime.factory import build_job_engine

    config = JobConfig.model_validate(config_dict)
    t0 = time.perf_counter()
    engine = build_job_engine(config, device="cpu")
    t_build = time.perf_counter() - t0
    keep = {c: None for c in sample_ids}
    t0, c0 = time.perf_counter(), time.process_time()
    rows = 0
    for block in engine.iter_blocks(range(config.loss.num_classes)):
        rows += len(block)
        for i, c in enumerate(block.classes.tolist()):
            if c in keep:
                keep[c] = block.rows[i].clone()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "build_s": t_build,
        "rows": rows,
        "dim": engine.layout.dim,
        "sample_rows": keep,
        "engine": engine.name,
    }


def run_job(config_dict: dict, sample_rows: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The job through JobDriver on the already running local Ray; phases timed."""
    import psutil

    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.driver import JobDriver
    from classgrad.store import open_store

    def actor_cpu(pids: list[int]) -> float:
        total = 0.0
        for pid in pids:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        return total

    class TimedDriver(JobDriver):
        # Start-up ends when the last actor is ready (the first ones may have begun shards by
        # then: the job starts with the first ready actor; with a few actors on one machine they
        # start within a second of each other).
        def actor_ready(self, slot, info):
            super().actor_ready(slot, info)
            self.pids = [*getattr(self, "pids", []), info["pid"]]
            if len(self.pids) == min(self.config.cluster.num_workers, self.summary.shards_total):
                self.t_ready = time.perf_counter()
                self.cpu_ready = actor_cpu(self.pids)

        def _run_shards(self, store, todo, t_start, lease):
            super()._run_shards(store, todo, t_start, lease)
            self.t_done = time.perf_counter()
            self.cpu_done = actor_cpu(self.pids)  # the actors are still alive here

    config = JobConfig.model_validate(config_dict)
    driver = TimedDriver(config)
    t0 = time.perf_counter()
    summary = driver.run()
    t_end = time.perf_counter()
    store = open_store(config.store.url)
    ids = sorted(sample_rows)
    stored = store.rows(ids)
    want = np.stack([sample_rows[c].float().numpy() for c in ids])
    # Same engine, same rows, same order of arithmetic: only the store's float32 round trip.
    same = bool(np.allclose(stored, want, rtol=1e-5, atol=1e-7 * float(np.abs(want).max())))
    compute = driver.t_done - driver.t_ready
    return {
        "workers": config.cluster.num_workers,
        "status": summary.status,
        "rows": summary.rows,
        "bytes": summary.bytes,
        "startup_s": driver.t_ready - t0,
        "compute_s": compute,
        "teardown_s": t_end - driver.t_done,
        "total_s": t_end - t0,
        "per_row_s": compute / config.loss.num_classes,
        "complete": bool(store.is_complete),
        "actor_cpu_s": driver.cpu_done - driver.cpu_ready,
        "per_row_cpu_s": (driver.cpu_done - driver.cpu_ready) / config.loss.num_classes,
        "missing": store.missing_ranges(),
        "sample_rows_equal": same,
    }


def rss_child(args) -> None:
    """In a fresh process: a GradientWorker computes and writes every shard; print peak RSS."""
    import resource

    from classgrad.workers.actor_runtime.actor import GradientWorker

    config = json.loads(Path(args.rss_child).read_text())
    t0 = time.perf_counter()
    worker = GradientWorker(config, num_threads=1)
    rss_ready = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = 0
    for shard in range(worker.store.num_shards):
        rows += worker.compute_shard(shard)["rows"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "peak_rss_mib": peak / 1024,
                "rss_after_build_mib": rss_ready / 1024,
                "rows": rows,
                "seconds": time.perf_counter() - t0,
                "complete": bool(worker.store.is_complete),
            }
        )
    )


def rss_case(classes: int, args, workdir: Path) -> dict[str, Any]:
    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import prepare_store

    url = str(workdir / f"rss_{classes}.zarr")
    cfg = job_config(classes, args.spc, args.hidden, url, 1, args.shard_rows)
    prepare_store(JobConfig.model_validate(cfg))  # the driver's part: store and metadata
    path = workdir / f"rss_{classes}.json"
    path.write_text(json.dumps(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.end_to_end", "--rss-child", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(url, ignore_errors=True)
    return {"classes": classes, **result}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="C = 4,000, 1 repetition")
    parser.add_argument("--classes", type=int, help="C of the job (default 10,000; quick 4,000)")
    parser.add_argument("--spc", type=int, default=8, help="probe samples per class")
    parser.add_argument(
        "--model",
        choices=("mlp", "cnn"),
        default="mlp",
        help="mlp: wide rows, output-bound (writing is most of the work); cnn: compute-bound",
    )
    parser.add_argument("--hidden", type=int, default=128, help="MLP width (rows: D = hidden^2 + hidden)")
    parser.add_argument("--shard-rows", type=int, default=512)
    parser.add_argument("--reps", type=int, help="repetitions (default 3, quick 1)")
    parser.add_argument("--rss-classes", default="1000,10000", help="C values of the memory check")
    parser.add_argument("--sections", default="job,rss", help="job, rss")
    parser.add_argument("--dir", help="directory for the stores (default: a temp dir)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    if args.rss_child:
        logging.disable(logging.WARNING)
        rss_child(args)
        return
    classes = args.classes or (4000 if args.quick else 10000)
    reps = args.reps or (1 if args.quick else 3)
    sections = set(args.sections.split(","))
    torch.set_num_threads(1)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="classgrad-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": common.machine_info(),
        "args": vars(args) | {"classes": classes, "reps": reps},
        "loadavg_before": loadavg(),
        "targets": [],
    }
    print(f"load average before: {report['loadavg_before']} on {os.cpu_count()} cores")

    def target(name: str, value: float, goal: str, met: bool, detail: str = "") -> None:
        report["targets"].append({"name": name, "value": value, "goal": goal, "met": met, "detail": detail})

    try:
        if "job" in sections:
            import ray

            t0 = time.perf_counter()
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
            report["ray_init_s"] = time.perf_counter() - t0
            sample_ids = sorted({0, 1, classes // 3, classes // 2, classes - 1})
            alone, jobs = [], {1: [], 2: []}
            samples: dict[int, torch.Tensor] = {}
            for rep in range(reps):
                a = engine_alone(job_config(classes, args.spc, args.hidden, "unused", 1, args.shard_rows), sample_ids)
                samples = a.pop("sample_rows")
                alone.append(a)
                print(f"rep {rep + 1}: engine alone {fmt_s(a['seconds'])} for {a['rows']:,} rows (D = {a['dim']:,})")
                for workers in (1, 2):
                    url = str(workdir / f"job_{workers}.zarr")
                    j = run_job(job_config(classes, args.spc, args.hidden, url, workers, args.shard_rows), samples)
                    jobs[workers].append(j)
                    print(
                        f"rep {rep + 1}: {workers} actor(s): start-up {fmt_s(j['startup_s'])}, compute "
                        f"{fmt_s(j['compute_s'])}, complete={j['complete']}, rows equal={j['sample_rows_equal']}"
                    )
                    shutil.rmtree(url, ignore_errors=True)
            ray.shutdown()
            best_alone = min(a["seconds"] for a in alone)
            cpu_alone = min(a["cpu_s"] for a in alone)
            best = {w: min(jobs[w], key=lambda j: j["compute_s"]) for w in (1, 2)}
            cpu_job = {w: min(j["actor_cpu_s"] for j in jobs[w]) for w in (1, 2)}
            per_row_alone = best_alone / classes
            over = best[1]["per_row_s"] / per_row_alone
            over_cpu = cpu_job[1] / cpu_alone
            speedup = best[1]["compute_s"] / best[2]["compute_s"]
            dim = alone[0]["dim"]
            what = f"MLP hidden {args.hidden}" if MODEL == "mlp" else "CNN (zoo.small_cnn, width 8)"
            print(
                f"\n== job vs engine alone: {what}, C = {classes:,}, {args.spc}/class, "
                f"D = {dim:,} ({classes * dim * 4 / 2**20:,.0f} MiB of rows), "
                f"Ray start-up {fmt_s(report['ray_init_s'])}"
            )
            print_table(
                [
                    "run",
                    "start-up (excluded)",
                    "compute (wall)",
                    "per row",
                    "vs engine alone",
                    "CPU time",
                    "CPU vs alone",
                    "store complete",
                    "rows equal",
                    "bytes written",
                ],
                [
                    [
                        "engine alone (no Ray, no store)",
                        fmt_s(alone[0]["build_s"]),
                        fmt_s(best_alone),
                        f"{per_row_alone * 1e6:.0f} us",
                        "1.00x",
                        fmt_s(cpu_alone),
                        "1.00x",
                        "-",
                        "-",
                        "-",
                    ]
                ]
                + [
                    [
                        f"job, {w} actor{'s' if w > 1 else ''}",
                        fmt_s(best[w]["startup_s"]),
                        fmt_s(best[w]["compute_s"]),
                        f"{best[w]['per_row_s'] * 1e6:.0f} us",
                        f"{best[w]['per_row_s'] / per_row_alone:.2f}x",
                        fmt_s(cpu_job[w]),
                        f"{cpu_job[w] / cpu_alone:.2f}x",
                        str(best[w]["complete"]),
                        str(best[w]["sample_rows_equal"]),
                        f"{best[w]['bytes']:,}",
                    ]
                    for w in (1, 2)
                ],
            )
            print(
                f"2 actors vs 1 (wall): {speedup:.2f}x.  Best of {reps}; CPU time = user+system of the actor "
                f"processes (all their threads: compute, writer, Ray) between 'ready' and 'done'."
            )
            report["job"] = {
                "classes": classes,
                "dim": dim,
                "engine_alone": alone,
                "jobs": jobs,
                "per_row_alone_s": per_row_alone,
                "job_over_alone": over,
                "job_over_alone_cpu": over_cpu,
                "speedup_2_vs_1": speedup,
            }
            ok_store = all(j["complete"] and j["sample_rows_equal"] for w in (1, 2) for j in jobs[w])
            target(
                "job per row within 15% of the engine alone (1 actor, wall)",
                over,
                "<= 1.15",
                over <= 1.15 and ok_store,
                f"store complete and rows equal: {ok_store}",
            )
            target(
                "job CPU time within 15% of the engine alone (1 actor)",
                over_cpu,
                "<= 1.15",
                over_cpu <= 1.15 and ok_store,
                "actor CPU (compute + writer + Ray) vs engine CPU",
            )
            target(
                "2 actors vs 1 actor speed-up",
                speedup,
                ">= 1.7",
                speedup >= 1.7,
                f"load average {loadavg()} on {os.cpu_count()} cores",
            )
        if "rss" in sections:
            cases = [rss_case(int(c), args, workdir) for c in args.rss_classes.split(",")]
            print("\n== actor peak RSS (GradientWorker without Ray, fresh process per C)")
            print_table(
                ["C", "rows", "peak RSS", "RSS after build", "seconds", "store complete"],
                [
                    [
                        f"{c['classes']:,}",
                        f"{c['rows']:,}",
                        f"{c['peak_rss_mib']:.0f} MiB",
                        f"{c['rss_after_build_mib']:.0f} MiB",
                        f"{c['seconds']:.1f}",
                        str(c["complete"]),
                    ]
                    for c in cases
                ],
            )
            ratio = max(c["peak_rss_mib"] for c in cases) / min(c["peak_rss_mib"] for c in cases)
            report["rss"] = {"cases": cases, "ratio": ratio}
            target(f"actor peak RSS flat in C ({args.rss_classes})", ratio, "<= 1.1", ratio <= 1.1)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["loadavg_after"] = loadavg()
    common.print_targets(report["targets"])
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
