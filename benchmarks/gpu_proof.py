"""Proof on a GPU (issue 49): exactness against the float64 CPU reference, then speed beside the floor.

One command for a lent GPU (``scripts/gpu_proof.sh`` installs the carried wheels and calls this),
at most 8 minutes on one H200; each section runs on its own, a failure is recorded and the next
section runs. Writes ``log.txt`` (what it printed) and ``gpu_proof.json`` (every figure) into
``--out``.

Sections (``--sections``, default all), in the order they run (the headline early, so that the
time limit cuts the long tail of ``speed`` rather than it):

- ``env``: the device, torch's version and its TF32 defaults.
- ``exact``: the engine harness of the CPU tests (``tests/support/engine_cases``: every model x
  loss x engine the tests run) on the device against the float64 CPU reference, with the tests'
  tolerances: fp32 (2e-6), fp16 and bf16 (``LOW_PRECISION_TOLERANCE``); fp32 once with torch's
  TF32 flags off and once on for matmuls and convolutions: the engines turn TF32 off under fp32
  (``PrecisionPolicy.float32_arithmetic``), so the flags must not change the rows; the seven
  real-model families (``benchmarks.real_model_cases``, tiny configs) fp32 against the reference.
- ``cuda_tests``: the unit tests CI skips for want of CUDA (marked ``cuda``), by pytest.
- ``scaler``: ``PerClassGradScaler`` with a CUDA fp16 ``GradScaler`` against a plain
  ``GradScaler`` loop on the same forced overflow: the same skipped steps, scale and state.
- ``headline``: ResNet-18 (``zoo.resnet18``, 224 px unless ``--quick``), 10 samples per class,
  C = 10,000, ``projection.dim`` 4,096, fp32 then bf16: the whole projected matrix, its time and
  its floor (one forward and backward of the summed loss over the same samples, in the engine's
  arithmetic), and GPU kernel time over wall (torch.profiler) on 64 classes' worth.
- ``actor``: the actor's compute-and-write loop without Ray (``GradientWorker`` on a local store):
  its first shard, then a warm shard with the rows' copy to the host on its side stream (beside
  the next block's compute) against the same loop with the copy on the compute stream, and
  against the engine alone over the same shard.
- ``grad_log``: ``GradLog.step`` on ResNet-18 at C = 10,000, k = 4,096, windows of 10, the
  background writer on, against a plain training step (``benchmarks/gpu_log_step.py``).
- ``syncs``: issue 46's reads from the device on the device itself: warm ``per_class_gradients``
  calls (the MLP, tiny BERT and GPT-2 of ``tests/unit/test_host_reads.py``, full and projected)
  under ``torch.cuda.set_sync_debug_mode("warn")``, synchronising calls counted per run (target:
  at most 2, the model's own included), and kernel time over wall on the hook path (target
  0.7); ``host_device.copy_to_host`` against ``.cpu()`` (the same values) and a loop of matmuls
  with each result copied off by each (the copy on a side stream should hide behind the next).
- ``projection``: the default projection's rows on the device against the CPU's (same seed):
  the same map, so fp32 roundoff apart.
- ``speed``: the default projection at C = 10,000 (k = 4,096) on the scale models and the seven
  real models, first call over its floor (until ``SUBPROCESS_RESERVE_S`` of the budget is left);
  then ``gpu_resnet18.py`` (fp32, bf16) and ``training_step.py`` (fp16, bf16) as subprocesses,
  within what is left of ``--budget-s``.

The shell script's ``timeout`` ends the run with SIGTERM: the section it was in is recorded with
what it had so far (``live``), and the report is written.

    scripts/gpu_proof.sh OUT_DIR                       # on the GPU machine (see the script)
    .venv/bin/python -m benchmarks.gpu_proof --device cpu --quick --out /tmp/gp   # CPU smoke run

Asserts nothing; a check's figure and whether it is within its tolerance are recorded. The last
lines of the log list what needs a look (a section or model that raised, a check beyond its
tolerance, a subprocess that failed), and the exit status is 1 when there is any.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_log_step import grad_log_step

log = logging.getLogger("gpu_proof")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 for CUDA matmuls and cuDNN convolutions on or off, put back after."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


# --- sections ----------------------------------------------------------------------------------


def env(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    out: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0]}
    if device.type == "cuda":
        out |= {
            "name": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
            "tf32_matmul_default": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn_default": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
    return out


def exact(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.engine_cases import (
        LOSS_CASES,
        LOW_PRECISION_TOLERANCE,
        MODEL_CASES,
        NUM_CLASSES,
        applicable,
        engine_for,
        max_relative_error,
        reference_rows,
    )

    tolerance = {"fp32": 2e-6, **LOW_PRECISION_TOLERANCE}  # tests/unit/test_engines.py's
    cases = []
    for m in MODEL_CASES:
        for loss in LOSS_CASES:
            for engine in ("partitioned", "dense"):
                if not applicable(m, loss, engine):
                    continue
                precisions = ["fp32"] + (["fp16", "bf16"] if loss in ("cross_entropy", "logit") else [])
                cases += [(m, loss, engine, p) for p in precisions]
    if args.quick:
        cases = [c for c in cases if c[0] in ("mlp", "cnn")]
    results = []
    for m, loss, engine, precision in cases:
        spc = 3 if precision == "fp32" else 8  # as the tests: more samples per class in low precision
        ref, _ = reference_rows(m, loss, samples_per_class=spc)
        row: dict[str, Any] = {"model": m, "loss": loss, "engine": engine, "precision": precision}
        try:
            for mode in (False, True) if precision == "fp32" and args.device != "cpu" else (False,):
                with tf32(mode):
                    eng = engine_for(m, loss, engine, precision=precision, samples_per_class=spc, device=args.device)
                    rows = eng.compute(range(NUM_CLASSES)).rows.cpu()
                row["error_tf32" if mode else "error"] = max_relative_error(rows, ref)
            row["ok"] = row["error"] <= tolerance[precision]
        except Exception as exc:  # noqa: BLE001 - one case's failure is a finding; the others still run
            row |= {"error": f"{type(exc).__name__}: {exc}", "ok": False}
        results.append(row)
    real = real_models(args)
    bad = [r for r in results if not r["ok"]] + [r for r in real if not r.get("ok")]
    tf32_worst = max((r.get("error_tf32", 0.0) for r in results), default=0.0)
    # The engines' fp32 is float32 whatever torch's TF32 flags: rows as close with them on as off.
    changed = [r for r in results if r.get("ok") and "error_tf32" in r and r["error_tf32"] > max(2 * r["error"], 2e-6)]
    log.info("exact: %d harness cases, %d real models, %d beyond tolerance; TF32 on: worst fp32 error %.2e",
             len(results), len(real), len(bad), tf32_worst)  # fmt: skip
    return {"harness": results, "real_models": real, "beyond_tolerance": bad, "tf32_worst_error": tf32_worst,
            "tf32_flags": {"changed_rows": changed, "ok": not changed}}  # fmt: skip


def cuda_tests(args: argparse.Namespace) -> dict[str, Any]:
    """The unit tests CI skips for want of CUDA (marked ``cuda`` through ``tests/support/devices.py``),
    run by pytest on this device."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    files = sorted(str(f.relative_to(root)) for f in (root / "tests" / "unit").glob("test_*.py")
                   if "tests.support.devices import" in f.read_text())  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", *files]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    log.info("cuda_tests (%d files): %s", len(files), summary)
    ran = args.device == "cpu" or "skipped" not in summary  # on a GPU none may be skipped
    return {
        "files": files,
        "returncode": done.returncode,
        "summary": summary,
        "ok": ran,
        "tail": done.stdout[-3000:] + done.stderr[-1000:],
    }


def real_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.real_model_cases import CASES, build_case
    from classgrad.workers.gradients import per_class_gradients
    from tests.support.engine_cases import max_relative_error

    out: list[dict[str, Any]] = []
    for name in CASES if not args.quick else CASES[:2]:
        try:
            case = build_case(name, 12)
            ref = per_class_gradients(
                copy.deepcopy(case.model).double(), case.samples, num_classes=12, engine="reference"
            )
            rows = per_class_gradients(case.model, case.samples, num_classes=12, device=args.device).cpu()
        except Exception as exc:  # noqa: BLE001 - one model's failure is a finding, not the end of the section
            out.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        # fp32 against float64 on models of a few layers: the harness's bound, with room for
        # the longer sums of attention and recurrent layers.
        error = max_relative_error(rows, ref)
        out.append({"model": name, "error": error, "ok": error <= 1e-5})
    return out


def projection(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.projection_scale import build
    from classgrad.workers.gradients import per_class_gradients

    out = []
    for name, classes in (("hf_resnet", 200 if args.quick else 2000), ("bag_text", 200 if args.quick else 2000)):
        model, samples, _ = build(name, classes)
        proj = {"dim": 256 if args.quick else 4096, "seed": 3}
        cpu = per_class_gradients(model, samples, num_classes=classes, projection=proj)
        with tf32(False):
            dev = per_class_gradients(model, samples, num_classes=classes, projection=proj, device=args.device).cpu()
        error = float(((dev - cpu).norm(dim=1) / cpu.norm(dim=1).clamp(min=1e-30)).max())
        out.append({"model": name, "classes": classes, "dim": proj["dim"], "error": error, "ok": error <= 1e-5})
    return {"cases": out}


def scaler(args: argparse.Namespace) -> dict[str, Any]:
    from torch import nn

    from classgrad import PerClassGradScaler

    device = torch.device(args.device)
    if device.type != "cuda":
        return {"skipped": "fp16 GradScaler on CUDA only"}
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6)).to(device)
    x, y = torch.randn(24, 8, device=device), torch.randint(0, 6, (24,), device=device)
    traces = {}
    for how in ("plain", "classgrad"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scale = torch.amp.GradScaler("cuda", init_scale=2.0**10) if how == "plain" else None
        per_class = PerClassGradScaler(precision="fp16", init_scale=2.0**10) if how == "classgrad" else None
        trace = []
        for step in range(6):
            opt.zero_grad()
            xs = x * (float("inf") if step in (1, 2) else 1.0)  # two steps that overflow in fp16
            with torch.autocast("cuda", dtype=torch.float16):  # step_batch takes its precision from it
                if scale is not None:
                    loss = nn.functional.cross_entropy(model(xs).float(), y)
                else:
                    assert per_class is not None
                    per_class.step_batch(model, xs, y, opt, num_classes=6)
            if scale is not None:
                scale.scale(loss).backward()
                scale.step(opt)
                scale.update()
                trace.append(scale.get_scale())
            else:
                assert per_class is not None
                trace.append(per_class.get_scale())
        traces[how] = {"scales": trace, "state": (scale or per_class).state_dict()}  # type: ignore[union-attr]
    same = traces["plain"]["scales"] == traces["classgrad"]["scales"]
    return {**traces, "same_scales": same, "ok": same}


def headline(args: argparse.Namespace) -> dict[str, Any]:
    from classgrad.workers import zoo
    from classgrad.workers.gradients import build_engine, projection_options

    device = torch.device(args.device)
    classes, per_class, size = (40, 2, 32) if args.quick else (10000, 10, 224)
    # 100,000 images of 224 px are 60 GB in float32: made on the device (the H200 holds them; the
    # engine's batches are then views, no copies), labels on the host, where the grid is planned.
    y = torch.arange(classes).repeat_interleave(per_class)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(len(y), 3, size, size, device=device, generator=gen)
    model = zoo.resnet18(classes, small_inputs=size <= 64, seed=0).eval().to(device)
    dim = 256 if args.quick else 4096
    batch = args.batch_size
    params = [p for p in model.parameters() if p.requires_grad]

    def floor() -> None:
        for start in range(0, len(y), batch):
            xb = x[start : start + batch]
            loss = torch.nn.functional.cross_entropy(model(xb), y[start : start + batch].to(device), reduction="sum")
            torch.autograd.grad(loss, params)

    out = live("headline", {"classes": classes, "per_class": per_class, "image": size, "dim": dim})
    for precision in ("fp32", "bf16"):
        if time.perf_counter() - STARTED > args.budget_s * 0.6:
            out[precision] = {"skipped": "over 60% of the run's budget spent before it"}
            continue
        try:
            proj = projection_options({"dim": dim})
            eng = build_engine(model, (x, y), num_classes=classes, batch_size=batch, device=device,
                               precision=precision, projection=proj)  # fmt: skip
            first, _ = timed(lambda eng=eng: eng.compute(range(classes)), device)
            out[precision] = {"first_call_s": first, "engine_notes": list(eng.stats.notes)}
            # The floor in the engine's arithmetic (fp32: TF32 off, as the engine computes).
            with eng.precision.autocast(device), eng.precision.float32_arithmetic(device):
                floor_s, _ = timed(floor, device)
            out[precision] |= {"floor_s": floor_s, "over_floor": first / floor_s}
            if device.type == "cuda":
                few = range(min(classes, 64))
                out[precision]["kernel_over_wall"] = kernel_over_wall(lambda eng=eng, few=few: eng.compute(few), device)
            log.info("headline %s: %.1f s, floor %.1f s (%.2fx)", precision, first, floor_s, first / floor_s)
        except Exception as exc:  # noqa: BLE001 - one precision's failure is a finding; the other still runs
            out[precision] = {**out.get(precision, {}), "error": f"{type(exc).__name__}: {exc}"}
            log.info("headline %s FAILED: %s", precision, out[precision]["error"])
    return out


def kernel_over_wall(fn: Callable[[], Any], device: torch.device) -> float:
    """GPU kernel time of one call of ``fn`` (torch.profiler, the kernels' own events) over the
    wall time of another call without the profiler (whose start and stop would count as wall)."""
    from torch.profiler import ProfilerActivity, profile

    wall, _ = timed(fn, device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    kernels = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e6
    return kernels / wall


def _syncs_of(name: str, projected: bool, classes: int, device: torch.device) -> dict[str, Any]:
    """Synchronising calls of one warm ``per_class_gradients`` call, per run (see ``syncs``)."""
    import warnings
    from unittest import mock

    from classgrad.workers.engines.partitioned.hook_path import HookPath
    from classgrad.workers.gradients import per_class_gradients
    from tests.support.read_cases import MODELS, probe

    model = MODELS[name](classes).to(device)
    data = probe(name, classes)
    kwargs = dict(num_classes=classes, batch_size=256, progress=False, device=str(device),
                  projection={"dim": 1024} if projected else None)  # fmt: skip
    per_class_gradients(model, data, **kwargs)
    cuda = device.type == "cuda"
    with mock.patch.object(HookPath, "_plan", autospec=True, side_effect=HookPath._plan) as plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn") if cuda else None
            try:
                per_class_gradients(model, data, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0) if cuda else None
    found = [str(w.message).splitlines()[0][:100] for w in caught if "synchroniz" in str(w.message)]
    out = {"runs": plan.call_count, "syncs": len(found), "per_run": len(found) / max(plan.call_count, 1)}
    out["first"] = found[:3] if cuda else "n/a (CPU: no sync debug mode)"
    if cuda:
        out["kernel_over_wall"] = kernel_over_wall(lambda: per_class_gradients(model, data, **kwargs), device)
    return out


def syncs(args: argparse.Namespace) -> dict[str, Any]:
    from classgrad.workers.engines import host_device

    device = torch.device(args.device)
    classes = 150 if args.quick else 2000
    out: dict[str, Any] = {}
    for name in ("mlp", "bert", "gpt2"):
        for projected in (False, True):
            out[f"{name}/{'projected' if projected else 'full'}"] = _syncs_of(name, projected, classes, device)
    side = 1024 if args.quick else 8192
    t = torch.randn(side, side, device=device)
    host, wait = host_device.copy_to_host(t)
    wait()
    out["copy_to_host_equal"] = bool(torch.equal(host, t.cpu()))

    def loop(copy: Callable[[torch.Tensor], Any]) -> None:
        pending = []
        for _ in range(8):
            pending.append(copy(t @ t))
        for p in pending:
            if callable(p):
                p()

    blocking, side = (lambda: loop(lambda r: r.cpu())), (lambda: loop(lambda r: host_device.copy_to_host(r)[1]))
    blocking(), side()  # warm: the pinned buffers' first allocation is not the copy's cost
    out["matmuls_blocking_copy_s"], _ = timed(blocking, device)
    out["matmuls_side_stream_copy_s"], _ = timed(side, device)
    return out


def actor(args: argparse.Namespace) -> dict[str, Any]:
    from unittest import mock

    import yaml

    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import prepare_store
    from classgrad.workers.actor_runtime.actor import GradientWorker
    from classgrad.workers.engines import host_device

    classes = 64 if args.quick else 2048
    with tempfile.TemporaryDirectory() as tmp:
        job = {
            "model": {"factory": "classgrad.workers.zoo:mlp",
                      "kwargs": {"num_classes": classes, "in_features": 64, "hidden": 256}},
            "data": {"factory": "classgrad.workers.zoo:synthetic_probe",
                     "kwargs": {"num_classes": classes, "samples_per_class": 4, "kind": "vector",
                                "input_shape": [64]}, "batch_size": 256},
            "loss": {"num_classes": classes},
            "engine": {"device": args.device},
            "sharding": {"shard_rows": classes // 2},
            "store": {"url": f"{tmp}/s.zarr", "row_chunk": 32},
        }  # fmt: skip
        config = JobConfig.model_validate(job)
        Path(f"{tmp}/job.yaml").write_text(yaml.safe_dump(job))
        store = prepare_store(config).store
        worker = GradientWorker(config.model_dump(mode="json"))
        device = torch.device(args.device)
        first_s, _ = timed(lambda: worker.compute_shard(0), device)  # the first call: plans, allocations

        def blocking(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Callable[[], None]]:
            return t.detach().to("cpu", dtype), lambda: None  # on the compute stream: it waits for the copy

        # The same warm shard, alternately, best of 2 each: the writer's copy on its side stream
        # (beside the next block's compute) and on the compute stream.
        side: list[float] = []
        inline: list[float] = []
        for _ in range(2):
            side.append(timed(lambda: worker.compute_shard(1), device)[0])
            with mock.patch.object(host_device, "copy_to_host", blocking):
                inline.append(timed(lambda: worker.compute_shard(1), device)[0])
        engine_s, _ = timed(lambda: worker.engine.compute(range(classes // 2, classes)), device)
        return {"classes_per_shard": classes // 2, "row_floats": store.dim, "first_shard_s": first_s,
                "side_stream_copy_s": min(side), "compute_stream_copy_s": min(inline), "engine_s": engine_s,
                "side_over_compute_stream": min(side) / min(inline),
                "loop_over_engine": min(side) / engine_s}  # fmt: skip


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """The default projection at C = 10,000 (k = 4,096) on the scale models and the seven real
    models: a first call over its floor, in this process; then ``gpu_resnet18.py`` (fp32, bf16)
    and ``training_step.py`` (fp16, bf16, time) as subprocesses, each within what is left of
    ``--budget-s``."""
    import subprocess

    from benchmarks.projection_scale import REAL, SCALE_MODELS, _floor, build
    from classgrad.workers.gradients import per_class_gradients

    device = torch.device(args.device)
    classes, dim = (100, 256) if args.quick else (10000, 4096)
    out = live("speed", {"classes": classes, "dim": dim, "models": {}})
    options = {"num_classes": classes, "device": device, "batch_size": args.batch_size,
               "projection": {"dim": dim}, "progress": False}  # fmt: skip
    for name in (*SCALE_MODELS, *REAL) if not args.quick else SCALE_MODELS:
        left = args.budget_s - (time.perf_counter() - STARTED)
        if left < SUBPROCESS_RESERVE_S and not args.quick:  # the two subprocesses' share of the budget
            out["models"][name] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        try:
            model, samples, _ = build(name, classes)
            model.to(device)
            first, _ = timed(lambda m=model, s=samples: per_class_gradients(m, s, **options), device)
            floor = _floor(model, samples, classes, dim, args.batch_size, device)
            out["models"][name] = {"first_call_s": first, "floor_s": floor, "over_floor": first / floor}
            log.info("speed %s: %.2f s, floor %.2f s (%.2fx)", name, first, floor, first / floor)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a finding, not the end
            out["models"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    quick = ["--quick"] if args.quick else []
    for label, cmd in (
        ("gpu_resnet18", ["benchmarks.gpu_resnet18", "--device", args.device, "--precisions", "fp32,bf16", *quick,
                          "--out", str(Path(args.out) / "gpu_resnet18.json")]),
        ("training_step", ["benchmarks.training_step", "--device", args.device, "--sections", "time",
                           "--precisions", "fp16,bf16" if device.type == "cuda" else "fp32", *quick,
                           "--out", str(Path(args.out) / "training_step.json")]),
    ):  # fmt: skip
        left = args.budget_s - (time.perf_counter() - STARTED)
        if left < 30:
            out[label] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        limit = left - 60 if label == "gpu_resnet18" and left > 120 else left  # a minute kept for the next
        try:
            done = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=limit)
            out[label] = {"returncode": done.returncode, "tail": done.stdout[-4000:] + done.stderr[-1000:]}
        except subprocess.TimeoutExpired as exc:  # what it printed so far is kept (bytes, whatever text=)
            printed = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            out[label] = {"error": f"stopped after {limit:.0f} s (the budget)", "tail": printed[-4000:]}
    return out


def needs_a_look(report: Any, path: str = "") -> list[str]:
    """Where ``report`` holds a failure: an ``error`` message (a float ``error`` is a figure), an
    ``ok`` that is False, or a subprocess's nonzero ``returncode``."""
    found = []
    if isinstance(report, dict):
        if isinstance(report.get("error"), str):
            found.append(f"{path}: {report['error'].splitlines()[0][:160]}")
        if report.get("ok") is False or report.get("returncode") not in (None, 0):
            brief = {k: v for k, v in report.items() if k not in ("tail", "traceback")}
            found.append(f"{path}: {brief}"[:240])
        for key, value in report.items():
            if key == "beyond_tolerance":  # the harness's own rows again
                continue
            found += needs_a_look(value, f"{path}/{key}" if path else str(key))
    elif isinstance(report, list):
        for i, value in enumerate(report):
            found += needs_a_look(value, f"{path}[{i}]")
    return found


# speed's in-process models stop when this much of the budget is left, for its two subprocesses.
SUBPROCESS_RESERVE_S = 150
# Sections' results as they grow (``live``): what a section had when the run's time limit stopped
# it goes into the report too.
LIVE: dict[str, dict[str, Any]] = {}


def live(section: str, out: dict[str, Any]) -> dict[str, Any]:
    LIVE[section] = out
    return out


class Stopped(BaseException):
    """SIGTERM, from ``scripts/gpu_proof.sh``'s ``timeout``: not an ``Exception``, so no section's
    per-case handler takes it for a finding and goes on."""


def _stop(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # timeout signals the group too: one stop is enough
    raise Stopped(f"signal {signum}")


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all (a stop in the middle leaves the last copy)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


STARTED = time.perf_counter()
SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "env": env, "exact": exact, "cuda_tests": cuda_tests, "scaler": scaler, "headline": headline, "actor": actor,
    "grad_log": grad_log_step, "syncs": syncs, "projection": projection, "speed": speed,
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True, help="folder for log.txt and gpu_proof.json")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=460, help="seconds the whole run may take (speed's subprocesses)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every section")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stream = io.StringIO()
    log.handlers.clear()  # a second run in one process (the smoke test) logs once, into its own log.txt
    for handler in (logging.StreamHandler(sys.stdout), logging.StreamHandler(stream)):
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    report: dict[str, Any] = {"args": vars(args)}
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _run_sections(args, report, out, stream)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_sections(args: argparse.Namespace, report: dict[str, Any], out: Path, stream: io.StringIO) -> int:
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        stopped = False
        try:
            report[name] = SECTIONS[name](args)
        except Stopped:
            stopped = True
            report[name] = {**LIVE.get(name, {}), "error": "stopped by the run's time limit (SIGTERM) in this section"}
            log.info("%s STOPPED by the run's time limit", name)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            log.info("%s FAILED: %s: %s", name, type(exc).__name__, exc)
        report[name]["seconds"] = time.perf_counter() - t0
        log.info("%s done in %.1f s", name, report[name]["seconds"])
        _write(
            out / "gpu_proof.json", json.dumps(report, indent=2, default=str)
        )  # after each: a cut run keeps its part
        _write(out / "log.txt", stream.getvalue())
        if stopped:
            break
    found = needs_a_look({k: v for k, v in report.items() if k != "args"})
    for line in found:
        log.info("needs a look: %s", line)
    log.info("%d findings need a look", len(found))
    _write(out / "log.txt", stream.getvalue())
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
