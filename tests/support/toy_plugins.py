"""A job's own engine, loss and projection structure, registered from outside the package.

Holds one registration each, as a user's module would (``engine.plugins`` names this module in
a job file): ``toy_partitioned`` (the partitioned engine under another name), ``toy_ce`` (the
cross-entropy written by hand, class-partitioned) and ``toy_sketch`` (finished rows sketched by
the sparse sign sketch, under another name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from classgrad.workers.engines import register_engine
from classgrad.workers.engines.partitioned import PartitionedEngine
from classgrad.workers.losses import PartitionedLoss, register_loss
from classgrad.workers.projection.structures import Structure, get_structure, register_structure


def _ce(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), labels, reduction="none")


class ToyEngine(PartitionedEngine):
    name = "toy_partitioned"


register_engine(ToyEngine)
register_loss("toy_ce")(lambda c: PartitionedLoss(c, _ce, "toy_ce"))
register_structure(Structure("toy_sketch", False, get_structure("sketch").finished))


def unregister() -> None:
    """Take the three names back (tests: a process's other tests see the built-in names only)."""
    import sys

    from classgrad.config import choices
    from classgrad.workers.engines import ENGINES
    from classgrad.workers.losses import LOSSES
    from classgrad.workers.projection.structures import STRUCTURES

    for registry, names, name in (
        (ENGINES, choices.ENGINE_KINDS, "toy_partitioned"),
        (LOSSES, choices.LOSS_KINDS, "toy_ce"),
        (STRUCTURES, choices.STRUCTURES, "toy_sketch"),
    ):
        registry.pop(name, None)
        names.discard(name)
    sys.modules.pop(__name__, None)
