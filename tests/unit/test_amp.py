"""Mixed precision (``classgrad.workers.amp``) through the engines: only the rows that overflow
are recomputed."""

from __future__ import annotations

import pytest
import torch

from classgrad.service.errors import RowOverflowError
from tests.support.engine_cases import NUM_CLASSES, max_relative_error
from classgrad.workers import zoo
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.engines import build_engine
from classgrad.workers.losses import partitioned_loss

# --- through the engines: only the rows that overflow are recomputed ----------------------

HOT_CLASSES = [1, 4]
CLASS_FACTOR = torch.ones(NUM_CLASSES)
CLASS_FACTOR[HOT_CLASSES] = 2.0**8


@partitioned_loss
def hot_logit(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean own-class logit, 256x larger for the hot classes: their fp16 gradients overflow at a
    scale the other classes take easily."""
    return outputs.gather(1, labels[:, None]).squeeze(1) * CLASS_FACTOR.to(outputs.device)[labels]


def _hot_engine(engine: str, **options):
    data = zoo.synthetic_probe(NUM_CLASSES, 4, kind="vector", input_shape=(8,), seed=3)
    return build_engine(zoo.mlp(NUM_CLASSES, in_features=8, hidden=16).eval(), data, num_classes=NUM_CLASSES,
                        loss=hot_logit, engine=engine, batch_size=8, **options)


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_fp16_recomputes_exactly_the_overflowing_rows(engine):
    # 2^12 / 4 samples = 1024 at the logits: fine for ordinary classes; x256 overflows fp16 (max 65504).
    policy = PrecisionPolicy("fp16", init_scale=2.0**12)
    block = _hot_engine(engine, precision=policy).compute(range(NUM_CLASSES))
    truth = _hot_engine("reference").compute(range(NUM_CLASSES)).rows
    assert sorted(block.recomputed.nonzero().squeeze(1).tolist()) == HOT_CLASSES
    assert bool((block.loss_scale[HOT_CLASSES] < 2.0**12).all())
    cold = [c for c in range(NUM_CLASSES) if c not in HOT_CLASSES]
    assert bool((block.loss_scale[cold] == 2.0**12).all())
    assert bool(torch.isfinite(block.rows).all())
    # fp16 roundoff 4.9e-4 over the 3 layers of the MLP: 1e-2 is 20 roundoffs (see test_engines).
    assert max_relative_error(block.rows, truth) <= 1e-2


@pytest.mark.parametrize("engine", ["partitioned", "dense"])
def test_fp16_row_that_never_becomes_finite_names_its_class(engine):
    policy = PrecisionPolicy("fp16", init_scale=2.0**12, min_scale=2.0**12)  # no smaller scale allowed
    # The first block holding a stuck row stops the job, naming that row's class.
    with pytest.raises(RowOverflowError, match=r"class\(es\) \[1\] stay non-finite down to loss scale 4096"):
        _hot_engine(engine, precision=policy).compute(range(NUM_CLASSES))
