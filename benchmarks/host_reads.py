"""Reads from the device and ATen ops per micro-batch, beside the floor's (issue 46).

For each model (tiny configs as in ``tests/unit/test_host_reads.py``; classes of 1 to 4 samples,
micro-batches of ``--batch-size``), a warm ``per_class_gradients`` call is counted on the CPU by
``tests/support/host_reads.py``, with a GPU's routes (``rule_io.routes_as("cuda")``) and with the
CPU's, unprojected and with the default projection:

- ``reads/run``: reads of device data by the engine per run (a micro-batch of whole classes);
  ``model's own``: reads inside the model's forward (the floor makes them too);
- ``ops/run`` and ``ops/floor op``: ATen ops per run, and over those of the floor (one forward
  and backward of the summed loss over the same micro-batch);
- ``step_batch``: reads per training step (``PerClassGradScaler.step_batch``, 64 samples, SGD).

Counts, not times: they are the same on any machine. Target: at most 2 reads per run on every
model, projected or not; ops per run not growing with C (compare ``--classes 500`` and ``4000``).

    .venv/bin/python -m benchmarks.host_reads                    # C = 500, every model
    .venv/bin/python -m benchmarks.host_reads --classes 4000 --models mlp,bert
    .venv/bin/python -m benchmarks.host_reads --classes 20000 --models mlp --projections default  # 79 row chunks
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import print_table
from classgrad.workers.model_io import ModelIO
from tests.support.host_reads import HostReads
from tests.support.read_cases import MODELS, counted, probe, step_counted


def engine_counts(
    name: str, classes: int, batch: int, projected: bool, routes: str | None
) -> tuple[float, float, float]:
    """``(reads, model's own reads, ops)`` per run of a warm call."""
    projection = {"dim": 256} if projected else None
    reads, runs = counted(MODELS[name](classes), probe(name, classes), classes, projection, routes, batch)
    runs = max(runs, 1)
    return reads.count / runs, reads.apart / runs, reads.ops / runs


def floor_ops(name: str, classes: int, batch: int) -> float:
    """ATen ops of one forward and backward of the summed loss over a micro-batch."""
    model = MODELS[name](classes)
    inputs, labels = probe(name, classes)
    take = slice(0, batch)
    x = {k: v[take] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[take]
    io = ModelIO(model, None, torch.device("cpu"))
    reads = HostReads(model)
    with reads:
        F.cross_entropy(io(x), labels[take], reduction="sum").backward()
    return float(reads.ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--models", default=",".join(sorted(MODELS)))
    parser.add_argument(
        "--projections", default="none,default", help="none (full rows), default: only default past a few thousand C"
    )
    args = parser.parse_args()
    projections = args.projections.split(",")
    if not set(projections) <= {"none", "default"}:
        parser.error(f"--projections: none, default or both, got {args.projections!r}")
    rows = []
    names = args.models.split(",")
    for name in names:
        floor = floor_ops(name, args.classes, args.batch_size)
        for projected in (p == "default" for p in projections):
            gpu = engine_counts(name, args.classes, args.batch_size, projected, "cuda")
            cpu = engine_counts(name, args.classes, args.batch_size, projected, None)
            rows.append(
                [
                    name,
                    "default" if projected else "none",
                    f"{gpu[0]:.1f}",
                    f"{cpu[0]:.1f}",
                    f"{gpu[1]:.1f}",
                    f"{gpu[2]:.0f}",
                    f"{gpu[2] / floor:.1f}",
                    f"{cpu[2] / floor:.1f}",
                ]
            )
    print(f"C = {args.classes}, micro-batches of {args.batch_size}, classes of 1-4 samples")
    header = ["model", "projection", "reads/run gpu", "reads/run cpu", "model's own", "ops/run gpu"]
    print_table(header + ["ops/floor op gpu", "ops/floor op cpu"], rows)
    if "none" not in projections:
        return  # step_batch's full rows: C x D
    steps = [[name, *(f"{step_counted(name, args.classes, r).count}" for r in ("cuda", None))] for name in names]
    print("\nPerClassGradScaler.step_batch, 64 samples: reads per step")
    print_table(["model", "reads/step gpu", "reads/step cpu"], steps)


if __name__ == "__main__":
    main()
