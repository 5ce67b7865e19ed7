"""Bad input to the engines: one clear error naming the problem (output width, labels out of
range, a non-finite loss), from the engine and from ``preflight``."""

from __future__ import annotations

import pytest

from classgrad.errors import InputError
from classgrad.workers import zoo
from classgrad.workers.actor_runtime.factory import preflight
from classgrad.workers.gradients import build_engine
from tests.support.engine_cases import NUM_CLASSES


def test_model_output_width_must_match_num_classes():
    data = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    for engine in ("partitioned", "dense", "reference"):
        eng = build_engine(zoo.mlp(NUM_CLASSES + 1, in_features=8).eval(), data, num_classes=NUM_CLASSES, engine=engine)
        with pytest.raises(InputError, match=r"model output has shape \(\d+, 7\), expected \(batch, 6\)"):
            eng.compute(range(NUM_CLASSES))
        with pytest.raises(InputError, match="model output has shape"):
            preflight(eng)


def test_labels_outside_the_class_range_are_refused():
    x, y = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    y[3] = NUM_CLASSES
    message = r"labels outside num_classes \(loss.num_classes\) \[0, 6\): sample 3 has label 6"
    with pytest.raises(InputError, match=message):
        build_engine(zoo.mlp(NUM_CLASSES, in_features=8), (x, y), num_classes=NUM_CLASSES)


@pytest.mark.parametrize("engine", ["partitioned", "dense", "reference"])
def test_non_finite_loss_names_the_class(engine):
    x, y = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(8,))
    x[int((y == 2).nonzero()[0])] = float("nan")
    eng = build_engine(
        zoo.mlp(NUM_CLASSES, in_features=8).eval(), (x, y), num_classes=NUM_CLASSES, engine=engine, loss="cross_entropy"
    )
    with pytest.raises(InputError, match=r"non-finite loss for class\(es\) \[2"):
        eng.compute(range(NUM_CLASSES))
    with pytest.raises(InputError, match="NaN/Inf in the inputs of probe sample 4"):
        preflight(eng)
