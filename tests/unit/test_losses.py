"""Loss kinds (``classgrad.workers.losses``): the registry and target checks."""

from __future__ import annotations

import pytest

from classgrad.service.config import BUILTIN_LOSS_KINDS
from classgrad.service.errors import InputError
from tests.support.engine_cases import NUM_CLASSES
from classgrad.workers import zoo
from classgrad.workers.engines import build_engine
from classgrad.workers.losses import LOSSES, create_loss

def test_unknown_loss_kind_lists_choices_and_registry_matches_config():
    with pytest.raises(InputError, match="choices: bce, cross_entropy, logit"):
        create_loss("hinge", 10)
    assert set(LOSSES) == set(BUILTIN_LOSS_KINDS)


def test_bce_needs_multi_hot_targets():
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    with pytest.raises(InputError, match=r"multi-hot of shape \[N, 6\]"):
        build_engine(zoo.mlp(NUM_CLASSES, in_features=8), data, num_classes=NUM_CLASSES, loss="bce")
