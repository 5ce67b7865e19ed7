"""Which parameters a Kronecker projection covers on GPT-2, and its rows per second (issue 18).

The tiny GPT-2 of ``real_model_cases`` (vocabulary 512, hidden 64, 2 layers, sequences of 4 to
16 tokens, every class 1 to 4 samples) through ``per_class_gradients(...,
projection={"structure": "kronecker", "dim": k})``, every parameter selected, one thread. Two
variants in one process: ``after`` (this code: transformers' ``Conv1D`` and ``nn.Embedding`` are
Kronecker units) and ``before`` (the same code with those two shapes unregistered, which is the
selection of the code before them: Linear and Conv2d only, so GPT-2's projections and tables
join the rest). For each: parameters in units, in the rest, the layers ``low_rank: dense`` sent
to the rest (``describe()`` of an engine built with the same options), and rows per second of
the Python API (best of ``--reps``, after one warm-up call). The unprojected engine's rows per
second are reported beside them.

    .venv/bin/python -m benchmarks.kronecker_layers                 # C = 200, k = 1,024
    .venv/bin/python -m benchmarks.kronecker_layers --classes 50 --reps 1

Prints a table and writes ``benchmarks/out/kronecker_layers.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks.common import print_table
from benchmarks.real_model_cases import build_case

OUT = common.OUT_DIR / "kronecker_layers.json"
CONV1D = ("transformers.pytorch_utils", "Conv1D")


@contextlib.contextmanager
def new_units_unregistered() -> Iterator[None]:
    """The unit selection of the code before Conv1D and Embedding units (Linear, Conv2d only)."""
    from classgrad.workers.engines.layer_rules import layer_shapes

    embedding = layer_shapes.OUTER_SHAPES.pop(nn.Embedding)
    conv1d = layer_shapes.LAZY_SHAPES.pop(CONV1D)
    try:
        yield
    finally:
        layer_shapes.OUTER_SHAPES[nn.Embedding] = embedding
        layer_shapes.LAZY_SHAPES[CONV1D] = conv1d


def coverage(model: nn.Module, data: Any, classes: int, projection: dict[str, Any]) -> dict[str, Any]:
    """Parameters in units and in the rest, by ``describe()`` of an engine with these options."""
    from classgrad.workers.gradients import build_engine, projection_options

    eng = build_engine(model, data, num_classes=classes, projection=projection_options(projection))
    described = eng.describe()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    in_units = sum(sizes[u["param"]] + (sizes[u["bias"]] if u["bias"] else 0) for u in described["units"])
    return {
        "units": [u["param"] for u in described["units"]],
        "params_in_units": in_units,
        "params_in_rest": sum(sizes[n] for n in described["rest_params"]),
        "dense_layers": described["dense_layers"],
        "rest_width": described["rest_width"],
    }


def rows_per_second(model: nn.Module, data: Any, classes: int, reps: int, projection: dict | None) -> float:
    from classgrad import per_class_gradients

    def call() -> float:
        t0 = time.perf_counter()
        rows = per_class_gradients(model, data, num_classes=classes, progress=False, projection=projection)
        assert rows.shape[0] == classes
        return time.perf_counter() - t0

    call()  # warm-up: the engine's one-off choices and the split's measurement
    return classes / min(call() for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--dim", type=int, default=1024, help="projection.dim")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = common.loadavg()
    case = build_case("gpt2", args.classes)
    data = case.batch(torch.arange(len(case.labels)))
    projection = {"structure": "kronecker", "dim": args.dim}
    report: dict[str, Any] = {"machine": common.machine_info(), "args": vars(args), "load_start": load_start}
    report["total_params"] = sum(p.numel() for p in case.model.parameters())
    report["samples"] = len(case.labels)
    report["unprojected_rows_per_s"] = rows_per_second(case.model, data, args.classes, args.reps, None)
    for variant in ("before", "after"):
        with new_units_unregistered() if variant == "before" else contextlib.nullcontext():
            info = coverage(case.model, data, args.classes, projection)
            info["rows_per_s"] = rows_per_second(case.model, data, args.classes, args.reps, projection)
        report[variant] = info
    report["load_end"] = common.loadavg()
    total = report["total_params"]
    print(f"GPT-2 tiny: {total:,} parameters, C = {args.classes}, {report['samples']} samples, k = {args.dim}")
    print(f"load average {load_start} at the start, {report['load_end']} at the end")
    print_table(
        ["variant", "units", "params in units", "params in rest", "rest width", "rows/s"],
        [["unprojected", "-", "-", f"{total:,}", "-", f"{report['unprojected_rows_per_s']:.1f}"]]
        + [
            [
                v,
                len(report[v]["units"]),
                f"{report[v]['params_in_units']:,} ({report[v]['params_in_units'] / total:.0%})",
                f"{report[v]['params_in_rest']:,}",
                report[v]["rest_width"],
                f"{report[v]['rows_per_s']:.1f}",
            ]
            for v in ("before", "after")
        ],
    )
    for v in ("before", "after"):
        print(f"{v}: units {report[v]['units']}; low_rank: dense -> rest {report[v]['dense_layers']}")
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
