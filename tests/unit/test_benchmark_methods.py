"""The benchmarks compare like with like: every alternative they time computes the same rows as
the reference engine (on a model small enough to run in a second), and ``floor_bound`` times
whole classes' work on every layer it bounds (outer-product, convolution, recurrent)."""

from __future__ import annotations

import pytest

from benchmarks import common
from classgrad.workers.gradients import per_class_gradients

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


def test_the_floor_bound_batches_whole_classes_and_times_every_layer() -> None:
    """``floor_bound`` bounds what a per-class method must do: its batches hold whole classes (a
    class's products need all its tokens), every sample once, and it times every outer layer."""
    import torch
    from torch import nn

    from benchmarks import floor_bound

    labels = torch.tensor([3, 0, 1, 1, 0, 2, 2, 2, 0, 4, 4, 1, 3])
    batches = floor_bound.class_batches(labels, batch_size=5)
    assert sorted(torch.cat(batches).tolist()) == list(range(len(labels)))  # every sample, once
    assert all(len(b) <= 5 for b in batches)
    owners = [set(labels[b].tolist()) for b in batches]
    assert all(not (a & b) for i, a in enumerate(owners) for b in owners[i + 1 :])  # no class split
    assert floor_bound.class_batches(torch.tensor([0] * 7 + [1]), batch_size=5)[0].numel() == 7  # too big: alone

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES)).eval()
    y = torch.arange(NUM_CLASSES).repeat(3)
    found = floor_bound.bound(model, (torch.randn(len(y), 5), y), NUM_CLASSES, dim=16, batch_size=8)
    assert len(floor_bound.outer_layers(model)) == 2
    assert found["activations_s"] > 0 and found["per_class_s"] > 0


def test_the_floor_bound_times_convolutions_and_recurrent_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Convolutions and one-layer recurrent layers count in the bound (their per-class sums are
    work any exact method does), at classes of unequal size."""
    import torch
    from torch import nn

    from benchmarks import floor_bound

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(5, 4, batch_first=True)
            self.head = nn.Linear(4, NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(x)[0][:, -1])

    torch.manual_seed(0)
    y = torch.repeat_interleave(torch.arange(NUM_CLASSES), torch.tensor([1, 2, 3, 1, 2, 4]))
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, NUM_CLASSES))
    cases = [(conv.eval(), torch.randn(len(y), 3, 6, 6)), (Recurrent().eval(), torch.randn(len(y), 7, 5))]
    timed: list[str] = []
    original = floor_bound.layer_bound

    def spy(module: nn.Module, *args: object) -> float:
        timed.append(type(module).__name__)
        return original(module, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(floor_bound, "layer_bound", spy)
    for model, x in cases:
        assert len(floor_bound.bounded_layers(model)) == 2 and len(floor_bound.outer_layers(model)) == 1
        timed.clear()
        found = floor_bound.bound(model, (x, y), NUM_CLASSES, dim=16, batch_size=8)
        assert found["per_class_s"] > 0
        batches = len(floor_bound.class_batches(y, 8))
        assert sorted(set(timed)) == sorted({type(m).__name__ for m in floor_bound.bounded_layers(model)})
        assert len(timed) == 2 * batches  # both layers, every batch


def test_a_benchmark_runs_on_another_checkout_s_code(tmp_path, capfd) -> None:
    """``before_after`` runs a benchmark module with classgrad's folders taken from ``--tree``: a
    tree of this checkout's folders runs it; with its ``workers`` folder empty the run fails."""
    from benchmarks import before_after

    broken = tmp_path / "tree"
    broken.mkdir()
    for folder in ("src", "service", "workers"):
        (broken / folder).symlink_to(before_after.ROOT / folder)
    args = ["--classes", "50", "--reps", "1"]
    assert before_after.run_module(broken, "benchmarks.engine_build", args) == 0  # the same code, by the tree
    assert "build_engine, C = 50" in capfd.readouterr().out
    (broken / "workers").unlink()
    (broken / "workers").mkdir()  # classgrad.workers empty there: nothing to import
    assert before_after.run_module(broken, "benchmarks.engine_build", args) != 0
