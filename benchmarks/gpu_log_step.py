"""The training log's step on a GPU (issue 59): ``GradLog.step`` against a plain training step.

Holds ``grad_log_step``, a section of ``benchmarks/gpu_proof.py`` (``--sections grad_log``):
ResNet-18 at 224 px, C = 10,000, batches of 256 (``--batch-size``) with random labels,
``GradLog(dim=4096, window=10)`` with its background writer on, ``SGD``. The model is in eval
mode (BatchNorm's running statistics frozen, as when fine-tuning): in train mode its samples are
not independent and the log takes the general route, which ``training_step.py`` times. The same
batches are timed as a plain step (forward, backward of the mean cross-entropy, optimizer step)
and as a logged step (the rows sketched inside the one backward), interleaved, after two warm-up
steps of each; the median of each is reported with their ratio (target: a logged step within
1.2x a plain step) and how many windows were written. ``--quick``: 32 px, C = 40, k = 256.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_log_step(args: argparse.Namespace) -> dict[str, Any]:
    from classgrad import GradLog
    from classgrad.store import read_log
    from classgrad.workers import zoo

    device = torch.device(args.device)
    classes, size, dim, steps = (40, 32, 256, 14) if args.quick else (10_000, 224, 4096, 24)
    batch = 16 if args.quick else args.batch_size
    gen = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(batch, 3, size, size, device=device, generator=gen) for _ in range(4)]
    ys = [torch.randint(0, classes, (batch,), device=device, generator=gen) for _ in range(4)]
    plain_model = zoo.resnet18(classes, small_inputs=size <= 64, seed=0).eval().to(device)
    logged_model = zoo.resnet18(classes, small_inputs=size <= 64, seed=0).eval().to(device)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=1e-3)
    logged_opt = torch.optim.SGD(logged_model.parameters(), lr=1e-3)

    def plain(step: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        x, y = xs[step % 4], ys[step % 4]
        torch.nn.functional.cross_entropy(plain_model(x), y).backward()
        plain_opt.step()

    times: dict[str, list[float]] = {"plain": [], "logged": []}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"{tmp}/log.zarr"
        with GradLog(url, logged_model, classes, window=10, dim=dim, background=True) as glog:

            def logged(step: int) -> None:
                logged_opt.zero_grad(set_to_none=True)
                glog.step(step, logged_model, xs[step % 4], ys[step % 4], logged_opt)

            for step in range(steps):
                for name, fn in (("plain", plain), ("logged", logged)):
                    _sync(device)
                    t0 = time.perf_counter()
                    fn(step)
                    _sync(device)
                    if step >= 2:  # warm-up: cuDNN's plans, the log's map
                        times[name].append(time.perf_counter() - t0)
        windows = read_log(url)["window"].tolist()
    plain_s, logged_s = statistics.median(times["plain"]), statistics.median(times["logged"])
    return {
        "classes": classes,
        "image": size,
        "batch": batch,
        "dim": dim,
        "window": 10,
        "steps": steps,
        "plain_step_s": plain_s,
        "logged_step_s": logged_s,
        "over_plain": logged_s / plain_s,
        "target_over_plain": 1.2,
        "logged_step_max_s": max(times["logged"]),
        "windows_written": windows,
    }
