"""Peak memory of the dense engine streaming the rows of many classes (issue 2's memory check).

For each dense loss (``--losses``: ``logit``, rows from a basis through the head; ``bce``, one
VJP per row from the head's input; ``log_softmax``, one VJP per row through the whole model,
not run by default: minutes per case at C = 10,000) and each C (``--classes``, default 1,000 and
10,000) a fresh subprocess builds the MLP of ``classgrad.workers.zoo`` with C outputs and the dense
engine, then streams all C rows block by block, discarding each block (``--sink discard``)
or writing it to a ``.npy`` memmap on disk (``--sink disk``). It reports its peak RSS
(``ru_maxrss``), the RSS right before the rows start, and the peak of the memory the rows
phase added. The row width is kept the same for every C: rows are the gradients of the first
two layers (``params``), which do not grow with C. (With the head included, one row is itself
proportional to C, and a block of rows must grow with it.)

Two probe-set shapes: ``stream`` (one micro-batch: blocks are yielded as computed) and
``accumulate`` (several micro-batches: a group of rows is summed over micro-batches).

Goal: peak RSS at C = 10,000 within 10% of C = 1,000, for each loss and shape.

    .venv/bin/python -m benchmarks.engine_memory
    .venv/bin/python -m benchmarks.engine_memory --quick     # C = 1,000 and 4,000

Prints a table and writes ``benchmarks/out/engine_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import print_table

OUT = common.OUT_DIR / "engine_memory.json"
SHAPES = {"stream": (256, 256), "accumulate": (512, 256)}  # probe samples, batch size


def child(args) -> None:
    import resource

    import numpy as np
    import torch

    from classgrad.workers import zoo
    from classgrad.workers.gradients import build_engine

    torch.set_num_threads(1)
    C, shape = args.child_classes, args.child_shape
    samples, batch = SHAPES[shape]
    model = zoo.mlp(C, in_features=32, hidden=args.hidden, depth=2).eval()
    x = torch.randn(samples, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, C, (samples,), generator=torch.Generator().manual_seed(1))
    if args.child_loss == "bce":  # multi-hot targets: each sample's label
        y = torch.nn.functional.one_hot(y, C).float()
    engine = build_engine(
        model,
        (x, y),
        num_classes=C,
        loss=common.DENSE_LOSSES[args.child_loss],
        engine="dense",
        batch_size=batch,
        params=["0.*", "2.*"],
    )
    sink = None
    if args.sink == "disk":
        sink = np.lib.format.open_memmap(
            Path(args.child_dir) / f"rows_{C}_{shape}.npy", mode="w+", dtype=np.float32, shape=(C, engine.layout.dim)
        )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    rows = 0
    for block in engine.iter_blocks(range(C)):
        if sink is not None:
            sink[block.classes.numpy()] = block.rows.numpy()
        rows += len(block)
        del block
    seconds = time.perf_counter() - t0
    if sink is not None:
        sink.flush()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "loss": args.child_loss,
                "classes": C,
                "shape": shape,
                "rows": rows,
                "dim": engine.layout.dim,
                "peak_rss_mib": peak / 1024,
                "rss_before_rows_mib": before / 1024,
                "rows_phase_added_mib": (peak - before) / 1024,
                "seconds": seconds,
                "block_rows": engine.block_rows,
                "group_rows": engine.group_rows,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="C = 1,000 and 4,000")
    parser.add_argument("--classes", help="comma-separated C values (default 1000,10000)")
    parser.add_argument("--hidden", type=int, default=64, help="MLP width (row width D = 32h + h + h^2 + h)")
    parser.add_argument("--shapes", default="stream,accumulate")
    parser.add_argument("--sink", default="discard", choices=["discard", "disk"])
    parser.add_argument(
        "--losses",
        default="logit,bce",
        help="comma-separated: logit (basis through the head), bce (per-row VJPs from the "
        "head's input), log_softmax (per-row VJPs through the whole model)",
    )
    parser.add_argument("--child-loss", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--child-classes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-shape", help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_classes:
        logging.disable(logging.WARNING)
        child(args)
        return
    classes = [int(c) for c in (args.classes or ("1000,4000" if args.quick else "1000,10000")).split(",")]
    results: list[dict[str, Any]] = []
    losses = args.losses.split(",")
    with tempfile.TemporaryDirectory(prefix="classgrad-mem-") as tmp:
        for loss in losses:
            for shape in args.shapes.split(","):
                for C in classes:
                    child_argv = [
                        "--child-classes",
                        str(C),
                        "--child-shape",
                        shape,
                        "--child-dir",
                        tmp,
                        "--sink",
                        args.sink,
                        "--hidden",
                        str(args.hidden),
                        "--child-loss",
                        loss,
                    ]
                    out = subprocess.run(
                        [sys.executable, "-m", "benchmarks.engine_memory", *child_argv],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    for f in Path(tmp).glob("*.npy"):
                        f.unlink()
    print(f"== dense engine, rows streamed and {args.sink}ed, fresh process per case")
    print_table(
        ["loss", "shape", "C", "D", "block", "peak RSS", "RSS before rows", "added by rows", "seconds"],
        [
            [
                r["loss"],
                r["shape"],
                f"{r['classes']:,}",
                f"{r['dim']:,}",
                str(r["block_rows"]),
                f"{r['peak_rss_mib']:.0f} MiB",
                f"{r['rss_before_rows_mib']:.0f} MiB",
                f"{r['rows_phase_added_mib']:.0f} MiB",
                f"{r['seconds']:.1f}",
            ]
            for r in results
        ],
    )
    targets = []
    for loss in losses:
        for shape in args.shapes.split(","):
            peaks = [r["peak_rss_mib"] for r in results if r["shape"] == shape and r["loss"] == loss]
            ratio = max(peaks) / min(peaks)
            targets.append(
                {
                    "name": f"{loss}, {shape}: peak RSS C={classes[-1]:,} vs C={classes[0]:,}",
                    "value": ratio,
                    "goal": "<= 1.10",
                    "met": ratio <= 1.10,
                }
            )
    common.print_targets(targets, ".3f")
    report = {"machine": common.machine_info(), "args": vars(args), "results": results, "targets": targets}
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
