"""A job's own engine, loss and projection structure, registered from outside the package.

Holds one registration each, as a user's module would (``engine.plugins`` names this module in
a job file): ``toy_partitioned`` (the partitioned engine under another name), ``toy_ce`` (the
cross-entropy written by hand, class-partitioned), and two projection structures, each one
subclass and one registration: ``toy_sketch`` (finished rows sketched by the sparse sign sketch)
and ``toy_tensorsketch`` (rows sketched inside the backward, by the default's map and sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from classgrad.workers.engines.partitioned import PartitionedEngine
from classgrad.workers.gradients import register_engine
from classgrad.workers.losses import PartitionedLoss, register_loss
from classgrad.workers.projection import SketchStructure, TensorSketchStructure, register_structure


def _ce(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), labels, reduction="none")


class ToyEngine(PartitionedEngine):
    name = "toy_partitioned"


register_engine(ToyEngine)
register_loss("toy_ce")(lambda c: PartitionedLoss(c, _ce, "toy_ce"))


class ToySketch(SketchStructure):
    name = "toy_sketch"


class ToyTensorSketch(TensorSketchStructure):
    name = "toy_tensorsketch"


register_structure(ToySketch())
register_structure(ToyTensorSketch())


def unregister() -> None:
    """Take the names back (tests: a process's other tests see the built-in names only)."""
    import sys

    from classgrad.workers.gradients import ENGINES
    from classgrad.workers.losses import LOSSES
    from classgrad.workers.projection import STRUCTURES

    ENGINES.unregister("toy_partitioned")  # each also takes the name out of config.choices
    LOSSES.unregister("toy_ce")
    STRUCTURES.unregister("toy_sketch")
    STRUCTURES.unregister("toy_tensorsketch")
    sys.modules.pop(__name__, None)
