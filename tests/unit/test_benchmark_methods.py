"""The benchmarks compare like with like: every alternative they time computes the same rows as
the reference engine (on a model small enough to run in a second)."""

from __future__ import annotations

import pytest

from benchmarks import common
from classgrad.workers.engines import per_class_gradients

NUM_CLASSES = 6


def _methods(case: common.Case, classes: list[int]) -> dict:
    methods = {
        "seed_loop": lambda h: common.seed_loop(case, classes, h),
        "grad_loop": lambda h: common.grad_loop(case, classes, h),
        "batched_onehot": lambda h: common.batched_onehot(case, classes, h, 4),
        "jacrev": lambda h: common.func_jacrev(case, classes, h, 4),
        "classgrad_dense": lambda h: common.classgrad(case, h, "dense"),
    }
    if case.partitioned:
        methods |= {
            "trak_vmap": lambda h: common.trak_vmap(case, h),
            "opacus_hooks": lambda h: common.opacus_hooks(case, h),
            "classgrad_partitioned": lambda h: common.classgrad(case, h, "partitioned"),
        }
    return methods


@pytest.mark.parametrize("loss", ["cross_entropy", "logit"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_every_timed_method_computes_the_reference_rows(model: str, loss: str) -> None:
    case = common.make_case(model, NUM_CLASSES, 3, loss=loss, width=4, hidden=8)
    case.batch_size = 8  # several micro-batches, so the methods' sums over them are exercised
    want = per_class_gradients(
        case.model, (case.x, case.y), num_classes=NUM_CLASSES, loss=loss, engine="reference", batch_size=case.batch_size
    )
    classes = list(range(NUM_CLASSES))
    for name, build in _methods(case, classes).items():
        holder: dict = {}
        build(holder)()
        ok, err = common.compare(common.held_rows(holder), holder["classes"], want, classes, "fp32")
        # compare() allows 1e-4 of the largest entry: fp32 sums taken in another order.
        assert ok, f"{name}: max relative error {err:.2e}"
        assert sorted(holder["classes"]) == classes, name
