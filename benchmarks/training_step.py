"""PerClassGradScaler in a training loop (issue 26): per-step time and peak memory against a plain step.

For each model (``--models``: ``cnn``, the small CNN of ``classgrad.workers.zoo``; ``vit`` and
``bert``, the tiny Hugging Face configs of ``benchmarks.real_model_cases``, dropout 0;
``mlp_dropout``, an MLP 256-512-512-C with dropout 0.1 after each hidden layer), each C
(``--classes``) and each precision (``--precisions``: fp32 and bf16 on a CPU, fp16 with
``--device cuda``), in train mode, on one batch of ``--batch-size`` samples with random labels,
SGD, every method timed round-robin (``common.interleaved``):

- ``plain``: ``zero_grad``, forward under autocast, mean cross-entropy, backward, ``step``.
- ``fast``: ``scaler.step_batch(model, x, y, opt)``: rows of the k classes present (the
  partitioned engine's hook path), their mean into ``.grad``, the step. ``floor fast``: plain +
  one write of the k x D rows (``common.memcpy_seconds``).
- ``general``: ``scaler(loss, opt, model=model, params=..., out=buf)`` on a dense [C] loss (each
  class's one-vs-rest BCE over the batch: every entry has a graph). Its columns are the
  parameters that do not grow with C (``GENERAL_PARAMS``: otherwise one row alone grows with C).
  Where C exceeds ``--general-rows`` the rows of the first ``--general-rows`` entries are computed
  (same blocks, same graph) and the time is scaled by C / rows: said in the table.
  ``floor general``: plain + one write of the C x D rows.
- ``seed``: the seed's loop: forward, then ``loss[c].backward(retain_graph=True)`` per class,
  ``.grad`` copied out and zeroed, the mean put back, the step; timed on ``--seed-classes``
  classes and extrapolated (forward + step once, backward x classes): against ``fast`` on the k
  classes' mean cross-entropy, against ``general`` on the [C] loss.

Peak memory (``--memory-precisions``, default fp32), per case in a fresh process whose allocator
maps every block of 64 KiB or more on its own (``CHILD_ENV``), so that the resident set follows
the live tensors: each of ``plain``, ``fast`` and ``general`` once to set up, then once more while
a thread samples the resident set every millisecond; reported: the peak above the resident set
before that run (model, optimizer, and ``general``'s rows buffer, made and touched before, are
not counted; the rows ``fast`` returns are). A peak shorter than a millisecond can be missed.

    .venv/bin/python -m benchmarks.training_step --quick      # a smoke run: tiny sizes
    .venv/bin/python -m benchmarks.training_step              # C = 1,000 and 10,000, three models

Targets (issue 26, C = 1,000): fast / floor fast <= 1.5 (goal 1.2); seed / fast >= 10; peak of
``general`` at C = 10,000 within 1.2x of C = 1,000. Prints ratios; asserts nothing on time. Writes
``benchmarks/out/training_step.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import common
from benchmarks.real_model_cases import IMAGE, SEQ_LEN, VOCAB, _hf
from classgrad import PerClassGradScaler
from classgrad.workers import zoo
from classgrad.workers.layout import ParamLayout
from classgrad.workers.model_io import ModelIO

OUT = common.OUT_DIR / "training_step.json"
MODELS = ("cnn", "vit", "bert", "mlp_dropout")
# Rows of the general route: parameters whose size does not depend on C (the CNN's convolutions,
# the transformers' second layer: ``encoder.layer.1`` or ``layers.1`` by transformers' version).
GENERAL_PARAMS = {"cnn": r"^features\.", "vit": r"layers?\.1\.", "bert": r"layers?\.1\.", "mlp_dropout": r"^[03]\."}


def general_params(name: str, model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if re.search(GENERAL_PARAMS[name], n)]


def build(name: str, num_classes: int, batch: int, device: torch.device, seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "cnn":
        model: nn.Module = zoo.small_cnn(num_classes, in_channels=3, width=16)
        x: Any = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
    elif name == "vit":
        model = _hf("vit", num_classes)
        x = {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=g)}
    elif name == "bert":
        model = _hf("bert", num_classes)
        x = {
            "input_ids": torch.randint(1, VOCAB, (batch, SEQ_LEN), generator=g),
            "attention_mask": torch.ones(batch, SEQ_LEN, dtype=torch.long),
        }
    elif name == "mlp_dropout":  # train-mode dropout: masks drawn as the samples go through
        model = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(512, num_classes),
        )  # fmt: skip
        x = torch.randn(batch, 256, generator=g)
    else:
        raise SystemExit(f"unknown model {name!r} (choices: {', '.join(MODELS)})")
    y = torch.randint(0, num_classes, (batch,), generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    x = {k: to(v) for k, v in x.items()} if isinstance(x, dict) else to(x)
    return model.to(device).train(), x, to(y)


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=common.AUTOCAST[precision])


def class_means(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each class present (ascending): the fast route's loss vector."""
    ids, local = torch.unique(y, return_inverse=True)
    per = F.cross_entropy(logits.float(), y, reduction="none")
    sums = torch.zeros(len(ids), device=per.device).index_add(0, local, per)
    return sums / torch.bincount(local, minlength=len(ids)).to(per.dtype)


def one_vs_rest(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Each class's one-vs-rest BCE over the batch: a dense [C] loss."""
    target = F.one_hot(y, num_classes).float()
    return F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none").mean(0)


def methods_for(name: str, C: int, precision: str, args, device: torch.device) -> tuple[dict, dict[str, Any]]:
    """The timed methods of one case, and its sizes."""
    model, x, y = build(name, C, args.batch_size, device)
    io = ModelIO(model, None, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = PerClassGradScaler(precision=precision, num_classes=C)
    params = [p for p in model.parameters() if p.requires_grad]
    D = sum(p.numel() for p in params)
    k = int(torch.unique(y).numel())
    general_names = general_params(name, model)
    general_layout = ParamLayout.from_model(model, include=general_names)
    general_tensors = general_layout.parameters(model)
    Dg = general_layout.dim
    n_general = min(C, args.general_rows)
    general_buf = torch.empty(n_general, Dg, device=device)
    cast = lambda: autocast(precision, device)  # noqa: E731

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        with cast():
            logits = io(x)
        F.cross_entropy(logits.float(), y).backward()
        opt.step()

    def fast() -> None:
        opt.zero_grad(set_to_none=True)
        with cast():
            scaler.step_batch(model, x, y, opt)

    def general() -> dict:
        opt.zero_grad(set_to_none=True)
        t0 = common.now()
        with cast():
            logits = io(x)
        loss = one_vs_rest(logits, y, C)[:n_general]
        scaler(loss, opt, model=model, params=general_names, out=general_buf)
        common.sync(device)
        return {"seconds": (common.now() - t0) * C / n_general}

    def seed(loss_of, chosen: list[torch.Tensor], total: int) -> dict:
        """The seed's loop on ``sample`` entries, extrapolated to ``total`` entries."""
        opt.zero_grad(set_to_none=True)
        t0 = common.now()
        with cast():
            logits = io(x)
        loss = loss_of(logits)
        t1 = common.now()
        sample = min(args.seed_classes, len(loss))
        rows = torch.empty(sample, sum(p.numel() for p in chosen), device=device)
        for c in range(sample):
            loss[c].backward(retain_graph=c < sample - 1)
            common.flat([p.grad for p in chosen], chosen, out=rows[c])
            for p in chosen:
                p.grad = None
        t2 = common.now()
        mean = rows.mean(0)
        offset = 0
        for p in chosen:
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        t3 = common.now()
        return {"seconds": (t1 - t0) + (t2 - t1) * total / sample + (t3 - t2)}

    seed_fast = lambda: seed(lambda lg: class_means(lg, y), params, k)  # noqa: E731
    seed_general = lambda: seed(lambda lg: one_vs_rest(lg, y, C), general_tensors, C)  # noqa: E731
    methods = {"plain": plain, "fast": fast, "general": general, "seed fast": seed_fast, "seed general": seed_general}
    general_buf.zero_()  # resident before any method runs: its pages are not the blocks' memory
    return methods, {"D": D, "D_general": Dg, "k": k, "n_general": n_general}


def measure(name: str, C: int, precision: str, args, device: torch.device) -> dict[str, Any]:
    methods, info = methods_for(name, C, precision, args, device)
    D, Dg, k, n_general = info["D"], info["D_general"], info["k"], info["n_general"]
    times = common.interleaved(methods, args.reps, device)
    best = {m: t.best for m, t in times.items()}
    write_fast = common.memcpy_seconds(k, D, device)
    write_general = common.memcpy_seconds(C, Dg, device)
    floor_fast = best["plain"] + write_fast
    floor_general = best["plain"] + write_general
    return {
        "model": name,
        "C": C,
        "precision": precision,
        "D": D,
        "D_general": Dg,
        "k": k,
        "general_rows_computed": n_general,
        "seconds": best,
        "median_seconds": {m: t.median for m, t in times.items()},
        "floor_fast_s": floor_fast,
        "floor_general_s": floor_general,
        "fast_over_floor": best["fast"] / floor_fast,
        "general_over_floor": best["general"] / floor_general,
        "seed_over_fast": best["seed fast"] / best["fast"],
        "seed_over_general": best["seed general"] / best["general"],
    }


MEMORY_METHODS = ("plain", "fast", "general")
# The child's allocator: every block of 64 KiB or more mapped on its own and returned on free, so
# that the resident set follows the live tensors (glibc's default threshold grows up to 32 MiB
# and keeps freed memory in its arenas, where a second run of anything costs no new pages).
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def sampled_peak(fn) -> float:
    """Peak resident set above the one before ``fn()`` (MiB), sampled every millisecond in a thread."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return (max(peak[0], proc.memory_info().rss) - before) / 2**20


def memory_child(spec: str) -> None:
    """In a fresh process (``CHILD_ENV``): each method once to set up, then once more measured:
    what it adds to the resident set (on a GPU: to the memory allocated), in MiB."""
    args = argparse.Namespace(**json.loads(spec))
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    methods, _ = methods_for(args.model, args.C, args.precision, args, device)
    out = {}
    for name in MEMORY_METHODS:
        methods[name]()
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            methods[name]()
            torch.cuda.synchronize()
            out[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        else:
            out[name] = sampled_peak(methods[name])
    print(json.dumps(out))


def peak_memory(r: dict[str, Any], args) -> dict[str, float]:
    """``memory_child`` of the case ``r``, in its own process."""
    spec = {**vars(args), "model": r["model"], "C": r["C"], "precision": r["precision"]}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.training_step", "--memory-child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **CHILD_ENV},
    )
    if done.returncode != 0:
        raise SystemExit(f"memory child failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--classes", default="1000,10000")
    parser.add_argument("--precisions", default=None, help="default: fp32,bf16 on a CPU, fp32,fp16 on a GPU")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed-classes", type=int, default=8, help="classes the seed's loop is timed on")
    parser.add_argument("--general-rows", type=int, default=1000, help="loss entries the general route computes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sections", default="time,memory", help="time, memory")
    parser.add_argument("--memory-precisions", default="fp32", help="precisions whose peak memory is measured")
    parser.add_argument("--quick", action="store_true", help="C = 50 and 200, batch 16, 1 rep (a smoke run)")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON report's path")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    if args.quick:
        args.classes, args.batch_size, args.reps, args.seed_classes, args.general_rows = "50,200", 16, 1, 4, 100
    device = torch.device(args.device)
    precisions = args.precisions or ("fp32,fp16" if device.type == "cuda" else "fp32,bf16")
    torch.set_num_threads(args.threads)
    clock = common.set_clock("auto", args.device, args.threads)
    logging.basicConfig(level=logging.WARNING)
    results = []
    sections = set(args.sections.split(","))

    def mem(r: dict[str, Any]) -> str:
        if "memory" not in r:
            return "-"
        return "/".join(f"{r['memory'][k]:.0f}" for k in MEMORY_METHODS)

    for name in args.models.split(","):
        for C in (int(c) for c in args.classes.split(",")):
            for precision in precisions.split(","):
                r: dict[str, Any] = {"model": name, "C": C, "precision": precision}
                if "memory" in sections and precision in args.memory_precisions.split(","):
                    r["memory"] = peak_memory(r, args)
                    print(f"{name} C={C} {precision}: MiB added plain/fast/general {mem(r)}", flush=True)
                if "time" in sections:
                    r.update(measure(name, C, precision, args, device))
                    s = r["seconds"]
                    print(f"{name} C={C} {precision}: fast {s['fast']:.4f}s, plain {s['plain']:.4f}s", flush=True)
                results.append(r)
    if "time" not in sections:
        common.write_report(args.out, {"machine": common.machine_info(), "args": vars(args), "results": results})
        return
    print(
        f"\n== training step, batch {args.batch_size}, {args.device}, {args.threads} threads, {clock} clock "
        f"(best of {args.reps}; general over its first {args.general_rows} entries scaled to C where C is larger)"
    )

    common.print_table(
        ["model", "C", "prec", "k", "D", "plain s", "fast s", "/ floor", "seed / fast", "general s", "/ floor",
         "seed / general", "MiB added plain/fast/general"],
        [
            [r["model"], r["C"], r["precision"], r["k"], r["D"], f"{r['seconds']['plain']:.4f}",
             f"{r['seconds']['fast']:.4f}", f"{r['fast_over_floor']:.2f}", f"{r['seed_over_fast']:.1f}",
             f"{r['seconds']['general']:.3f}", f"{r['general_over_floor']:.2f}", f"{r['seed_over_general']:.1f}",
             mem(r)]
            for r in results
        ],
    )  # fmt: skip
    targets = []
    for r in results:
        if r["C"] == 1000:
            targets.append(
                {
                    "name": f"{r['model']} {r['precision']} fast / floor",
                    "value": r["fast_over_floor"],
                    "goal": "<= 1.5 (1.2)",
                    "met": r["fast_over_floor"] <= 1.5,
                }
            )
            targets.append(
                {
                    "name": f"{r['model']} {r['precision']} seed / fast",
                    "value": r["seed_over_fast"],
                    "goal": ">= 10",
                    "met": r["seed_over_fast"] >= 10,
                }
            )
    by_key = {(r["model"], r["precision"], r["C"]): r for r in results}
    for (model, precision, C), r in by_key.items():
        small = by_key.get((model, precision, 1000))
        if C == 10000 and small is not None and "memory" in r and "memory" in small:
            ratio = r["memory"]["general"] / max(small["memory"]["general"], 1.0)
            targets.append(
                {
                    "name": f"{model} {precision} general peak C=10k / 1k",
                    "value": ratio,
                    "goal": "<= 1.2",
                    "met": ratio <= 1.2,
                }
            )
    if targets:
        common.print_targets(targets)
    common.write_report(
        args.out, {"machine": common.machine_info(), "args": vars(args), "results": results, "targets": targets}
    )


if __name__ == "__main__":
    main()
