"""What building an engine costs at many classes: seconds and the Python objects it leaves.

Every actor builds its engine over the whole probe set once, and every ``GradLog.step`` builds one
over its batch, so whatever the engine keeps per class (not per sample or per run) is paid at
C = 1,000,000 by every actor, and walked by every later full garbage collection.

    .venv/bin/python -m benchmarks.engine_build --classes 1000000
    .venv/bin/python -m benchmarks.before_after --tree /tmp/before --rounds 1 -- benchmarks.engine_build

A ``Linear(8, C)`` model, ``--per-class`` samples a class; the best of ``--reps`` builds and the
objects the garbage collector tracks while the engine is held. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch import nn

from benchmarks.common import print_table
from classgrad.workers.gradients import build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="C = 100,000 (run_all's quick mode)")
    args = parser.parse_args()
    if args.quick:
        args.classes = min(args.classes, 100_000)
    torch.set_num_threads(2)
    C = args.classes
    model = nn.Linear(8, C)
    x = torch.randn(args.per_class * C, 8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(C).repeat_interleave(args.per_class)
    gc.collect()
    before = len(gc.get_objects())
    best, held = float("inf"), 0
    for _ in range(args.reps):
        t0 = time.perf_counter()
        engine = build_engine(model, (x, y), num_classes=C, batch_size=256)
        best = min(best, time.perf_counter() - t0)
        held = len(gc.get_objects()) - before
        del engine
        gc.collect()
    print(f"build_engine, C = {C:,}, {args.per_class} samples a class: best of {args.reps}")
    print_table(["seconds", "objects tracked while held"], [[f"{best:.3f}", f"{held:,}"]])


if __name__ == "__main__":
    main()
