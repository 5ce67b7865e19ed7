"""Diagnostic measurements behind the explanations in RESULTS.md (not targets).

Sections (``--sections``, comma-separated; default all):

- ``dense-gap``: the dense engine's per-row path (VJPs through the whole model, on a loss that
  sees every output column) against the per-class loop on the CNN. Times, for every
  row (``--rows``, default all 256), one VJP per row on each of the engine's two micro-batch
  graphs against one VJP on the loop's graph (the same two micro-batches summed into one L,
  both graphs alive), the engine itself with block size 1, and the engine's per-row
  bookkeeping alone, with a stand-in graph that returns ready gradients. Graphs are rebuilt
  every repetition, and the timings alternate.
- ``worker-split``: where the end-to-end job's extra time goes (MLP, C = 10,000). The engine
  alone, the actor's class (``GradientWorker``, no Ray) with the store's writes replaced by a
  no-op, and with real writes (reporting the writer thread's time in the store), alternated.
- ``gaussian-chunks``: generation time of the gaussian projection per entry for several
  chunk sizes (pairs per elementwise pass), checking that the entries never change.
- ``page-faults``: writing a fresh 37 MB buffer against writing a recycled one.

All single-threaded; CPU time where the work is one thread, wall time otherwise (said per table).

    .venv/bin/python -m benchmarks.diagnostics
    .venv/bin/python -m benchmarks.diagnostics --sections dense-gap,page-faults

Prints tables and writes ``benchmarks/out/diagnostics.json``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import print_table

OUT = common.OUT_DIR / "diagnostics.json"


def dense_gap(reps: int, rows: int) -> dict[str, Any]:
    from classgrad.workers.gradients import build_engine

    # log_softmax: a dense loss that sees every output column, so the engine's VJPs run through
    # the whole model as the loops' do (logit and bce take paths through the head instead).
    case = common.make_case("cnn", 256, 8, loss="log_softmax", max_samples=512)
    eng = build_engine(
        case.model,
        (case.x, case.y),
        num_classes=case.num_classes,
        loss=case.loss,
        precision=case.precision,
        engine="dense",
        batch_size=case.batch_size,
        device=case.device,
        block_rows=1,
    )
    clock = time.process_time
    times: dict[str, list[float]] = {}
    with eng.selected_grads():
        for _ in range(reps):
            contribs = [eng.forward(mb)[1] for mb in eng.probe.micro_batches()]
            t0 = clock()
            for c in range(rows):
                for part in contribs:
                    torch.autograd.grad(part[c], eng.params, retain_graph=True)
            times.setdefault("a VJP on each of the engine's 2 micro-batch graphs", []).append((clock() - t0) / rows)
            del contribs
            L = case.loss_vector()
            t0 = clock()
            for c in range(rows):
                torch.autograd.grad(L[c], case.params, retain_graph=True)
            times.setdefault("one VJP on the loop's graph (both micro-batches)", []).append((clock() - t0) / rows)
            del L
            t0 = clock()
            for _block in eng.iter_blocks(range(rows)):
                pass
            times.setdefault("the engine, block size 1 (its 2 forwards included)", []).append((clock() - t0) / rows)

        # Bookkeeping alone: the engine's row path around a graph whose VJP is already done.
        eng._use_func = False
        graph = eng._graph(next(eng.probe.micro_batches()))
        ready = graph.single(torch.tensor(0), torch.tensor(1.0))

        class ReadyGraph:
            values = graph.values

            def single(self, _c, _scale):
                return ready

        stand_in = ReadyGraph()
        classes = torch.arange(case.num_classes)
        out = torch.empty(case.num_classes, eng.layout.dim)
        for _ in range(reps):
            t0 = clock()
            for c in range(case.num_classes):
                eng._rows_for(stand_in, classes[c : c + 1], out=out[c : c + 1])
            times.setdefault("engine bookkeeping per row and micro-batch", []).append((clock() - t0) / case.num_classes)
    best = {name: min(v) for name, v in times.items()}
    print(f"\n== dense gap: {case.name}, D = {case.dim:,}, CPU time, best of {reps}")
    print_table(
        ["what", "per row", "all repetitions"],
        [[name, f"{1e3 * t:.3f} ms", ", ".join(f"{1e3 * x:.2f}" for x in times[name])] for name, t in best.items()],
    )
    return {"case": case.name, "dim": case.dim, "seconds_per_row": times, "best": best}


def worker_split(reps: int, classes: int) -> dict[str, Any]:
    import end_to_end

    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import prepare_store
    from classgrad.workers.actor_runtime.actor import GradientWorker

    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="classgrad-diag-"))
    url = str(workdir / "split.zarr")
    cfg = end_to_end.job_config(classes, 8, 128, url, 1, 512)

    def worker(stub_writes: bool) -> dict[str, float]:
        shutil.rmtree(url, ignore_errors=True)
        prepare_store(JobConfig.model_validate(cfg))
        w = GradientWorker(cfg, num_threads=1)
        if stub_writes:
            w.store.write_rows = lambda start, rows, **kw: rows.nbytes
        t0, c0 = time.perf_counter(), time.process_time()
        write_s = sum(w.compute_shard(s)["write_seconds"] for s in range(w.store.num_shards))
        return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "write_s": write_s}

    def engine() -> dict[str, float]:
        r = end_to_end.engine_alone(cfg, [])
        return {"seconds": r["seconds"], "cpu_s": r["cpu_s"], "write_s": 0.0}

    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(reps):
            for name, fn in (
                ("engine alone", engine),
                ("worker, writes stubbed", lambda: worker(True)),
                ("worker", lambda: worker(False)),
            ):
                runs.setdefault(name, []).append(fn())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n== worker split: MLP hidden 128, C = {classes:,}, 8/class, wall time, each repetition")
    print_table(
        ["run", "seconds", "CPU seconds", "writer thread in the store"],
        [
            [
                name,
                ", ".join(f"{r['seconds']:.2f}" for r in rs),
                ", ".join(f"{r['cpu_s']:.2f}" for r in rs),
                ", ".join(f"{r['write_s']:.2f}" for r in rs),
            ]
            for name, rs in runs.items()
        ],
    )
    return {"classes": classes, "runs": runs}


def gaussian_chunks(reps: int) -> dict[str, Any]:
    from classgrad.workers import projection as P

    torch.set_num_threads(1)
    k, rows = 4096, 1024
    proj = P.Projector(1 << 20, k, kind="gaussian", seed=0)
    kind = P.PROJECTIONS["gaussian"]
    buf = torch.empty(rows * kind.buffer_cols(k))
    cpu = torch.device("cpu")
    reference = proj._generate(0, 0, rows, cpu, buf).clone()
    times: dict[int, list[float]] = {}
    original = kind.chunk_rows
    try:
        for _ in range(reps):
            for log2 in (14, 15, 16, 17, 18):
                kind.chunk_rows = lambda k_, device_type, pairs=1 << log2: max(1, pairs // kind.words_per_row(k_) * 2)
                t0 = time.process_time()
                got = proj._generate(0, 0, rows, cpu, buf)
                times.setdefault(log2, []).append(1e9 * (time.process_time() - t0) / (rows * k))
                if not torch.equal(got, reference):
                    raise AssertionError(f"chunk 2^{log2} pairs changed the entries")
    finally:
        kind.chunk_rows = original
    print(f"\n== gaussian generation per entry by chunk size (k = {k}, {rows} rows of R, CPU time, best of {reps})")
    print_table(["pairs per pass", "ns per entry"], [[f"2^{n}", f"{min(v):.1f}"] for n, v in times.items()])
    return {"ns_per_entry": {f"2^{n}": v for n, v in times.items()}}


def page_faults(reps: int) -> dict[str, Any]:
    n = 37_000_000 // 4
    times: dict[str, list[float]] = {}
    recycled = torch.empty(n)
    recycled.fill_(0.0)  # touch every page once
    for _ in range(reps):
        t0 = time.perf_counter()
        fresh = torch.empty(n)
        fresh.fill_(1.0)
        times.setdefault("fresh buffer", []).append(time.perf_counter() - t0)
        del fresh
        t0 = time.perf_counter()
        recycled.fill_(1.0)
        times.setdefault("recycled buffer", []).append(time.perf_counter() - t0)
    print(f"\n== writing 37 MB: fresh vs recycled buffer (wall time, best of {reps})")
    print_table(["buffer", "best"], [[name, common.fmt_s(min(v))] for name, v in times.items()])
    return {"seconds": times}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", default="dense-gap,worker-split,gaussian-chunks,page-faults")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (worker-split: 2)")
    parser.add_argument("--rows", type=int, default=256, help="dense-gap: rows per timed VJP loop (at most 256)")
    parser.add_argument("--classes", type=int, default=10_000, help="worker-split: C")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = args.sections.split(",")
    report: dict[str, Any] = {"machine": common.machine_info(), "args": vars(args)}
    if "dense-gap" in sections:
        report["dense_gap"] = dense_gap(args.reps, args.rows)
    if "worker-split" in sections:
        report["worker_split"] = worker_split(min(args.reps, 2), args.classes)
    if "gaussian-chunks" in sections:
        report["gaussian_chunks"] = gaussian_chunks(args.reps)
    if "page-faults" in sections:
        report["page_faults"] = page_faults(args.reps)
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
