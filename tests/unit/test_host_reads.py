"""Reads from the device per micro-batch: at most two, on a GPU's routes and on a CPU's.

A read (``.item()``, ``nonzero``, ``bincount``, ...) of device data makes a GPU's host wait for
the whole queue of launched work; counted here on the CPU by ``tests/support/host_reads.py``,
with the routes a GPU takes (``rule_io.routes_as("cuda")``: padded grids, no per-class loops)
and the CPU's own. The engine plans each run (a micro-batch of whole classes) on the host from
the labels and reads once when the run's work is queued (losses and finiteness flags); on the
CPU's routes, which drop a decoder's dead tokens, once more for every layer's live tokens.
The model's own reads (Hugging Face models read their attention masks) are counted apart: the
floor makes them too. Classes of 1 to 4 samples, micro-batches of 256 samples.
"""

from __future__ import annotations

import copy

import pytest
import torch

from classgrad.workers.engines import host_device
from classgrad.workers.engines.layer_rules.rule_io import routes_as
from classgrad.workers.gradients import build_engine, per_class_gradients
from tests.support.engine_cases import max_relative_error
from tests.support.read_cases import MODELS, counted, probe, step_counted

C = 150
BATCH = 256
MAX_READS = 2  # per run (issue 46's target)

pytestmark = pytest.mark.usefixtures("fresh_choices")


@pytest.mark.parametrize("routes", ["cuda", None], ids=["gpu_routes", "cpu_routes"])
@pytest.mark.parametrize("projected", [False, True], ids=["full", "projected"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_at_most_two_reads_per_micro_batch(name, projected, routes):
    model = MODELS[name](C)
    reads, runs = counted(model, probe(name, C), C, {"dim": 256} if projected else None, routes)
    assert runs >= 2
    assert reads.count <= MAX_READS * runs, f"{reads.count} reads in {runs} runs: {dict(reads.where)}"
    if routes == "cuda":  # a GPU's routes read once a run: the losses and the finiteness flags
        assert reads.count == runs, dict(reads.where)


@pytest.mark.parametrize(
    ("name", "projected", "classes", "growth"),
    [
        ("mlp", False, (C, 4 * C), 1.02),
        ("bert", False, (C, 4 * C), 1.02),
        ("cnn", False, (C, 4 * C), 1.02),
        # The default projection: from 4x to 16x the classes, once a call's first run (the units'
        # one-off set-up) weighs little; the head's sketch takes its row chunks of dim (C / 256
        # here) in one batched step (chunked_sketch.SPECTRA_BYTES), where a step a chunk grew
        # the MLP's ops by 4.5%.
        ("mlp", True, (4 * C, 16 * C), 1.02),
        ("cnn", True, (4 * C, 16 * C), 1.02),
    ],
)
def test_ops_per_micro_batch_do_not_grow_with_the_classes(name, projected, classes, growth):
    """Nothing loops over a run's classes on a GPU's routes: the ATen ops inside a run (the hook
    path's ``_rows``) per run, at two class counts. Unprojected they are the same to within the
    runs' mix of class sizes (a run whose classes all have one size takes no grid spots)."""
    per_run = []
    for c in classes:
        reads, runs = counted(MODELS[name](c), probe(name, c), c, {"dim": 256} if projected else None, "cuda")
        per_run.append(reads.ops_in_scope / runs)
    assert per_run[1] <= growth * per_run[0], per_run


@pytest.mark.parametrize("name", ["cnn", "bert", "gpt2", "lstm"])
def test_a_gpus_routes_give_the_reference_rows_on_a_cpu(name):
    """The padded routes a GPU takes, run on the CPU, against the float64 reference (float32
    roundoff over two-layer models, as tests/unit/test_real_models.py)."""
    classes = 12
    model, data = MODELS[name](classes), probe(name, classes, seed=3)
    with routes_as("cuda"):
        got = per_class_gradients(model, data, num_classes=classes, batch_size=16, progress=False)
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=classes, engine="reference")
    assert max_relative_error(got, ref.compute(range(classes)).rows) <= 1e-5


@pytest.mark.parametrize("name", ["mlp", "bert", "gpt2"])
def test_a_training_step_reads_its_labels_once_and_its_run_once(name):
    """``step_batch`` on a GPU batch, by a GPU's routes: the labels come to the host once (the run
    is planned from them) and the run reads once; the step's skip decision reads nothing more,
    since the run bounded every entry of its rows (``rule_io.sum_is_finite``). On a CPU's routes
    one more for live tokens, as for any run."""
    reads = step_counted(name, C, "cuda")
    assert reads.count <= MAX_READS, dict(reads.where)


def test_rows_leave_the_device_through_copy_to_host():
    """On a CPU the rows are used in place (float32 already) or converted, and nothing to wait
    for; the writer waits before it reads (the CUDA side stream is checked by gpu_proof's syncs)."""
    rows = torch.randn(5, 7)
    host, wait = host_device.copy_to_host(rows)
    wait()
    assert host.data_ptr() == rows.data_ptr()
    wide, wait = host_device.copy_to_host(rows.double())
    wait()
    assert wide.dtype == torch.float32 and torch.equal(wide, rows)
