"""The worker (``classgrad.workers.actor_runtime.actor``), used directly as a plain class, without Ray:
it computes whole shards into the store, marks a shard done only once every row is stored and
only while its run holds the lease (how rows are gathered before a projection:
``test_stored_rows.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classgrad.config import JobConfig
from classgrad.errors import LeaseHeldError
from classgrad.service.driver_runtime.preparation import prepare_store
from classgrad.store import open_store
from classgrad.workers.actor_runtime.actor import GradientWorker
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import per_class_gradients

C = 12


def config_for(tmp_path) -> JobConfig:
    """12 classes, shards of 4 rows in chunks of 2: three shards."""
    return JobConfig.model_validate(
        {
            "model": {
                "factory": "classgrad.workers.zoo:mlp",
                "kwargs": {"num_classes": C, "in_features": 6, "hidden": 8},
            },
            "data": {
                "factory": "classgrad.workers.zoo:synthetic_probe",
                "kwargs": {"num_classes": C, "samples_per_class": 2, "kind": "vector", "input_shape": [6]},
            },
            "loss": {"num_classes": C},
            "sharding": {"shard_rows": 4},
            "store": {"url": str(tmp_path / "s.zarr"), "row_chunk": 2},
        }
    )


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A worker sets this process's torch thread count (``num_threads``); later tests must not
    inherit it: fewer threads change the summation order their tolerances were sized for."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def worker(tmp_path) -> GradientWorker:
    config = config_for(tmp_path)
    prepare_store(config)
    return GradientWorker(config.model_dump(mode="json"), num_threads=1)


def test_the_worker_is_a_plain_class_whose_methods_run_without_ray(worker):
    assert not hasattr(GradientWorker, "remote")  # the driver wraps it with ray.remote; nothing here needs Ray
    identity = worker.ready()
    assert identity["engine"] == "partitioned" and identity["device"] == "cpu"
    assert {"node", "host", "pid"} <= set(identity)
    assert torch.get_num_threads() == 1  # num_threads: one torch thread, as each Ray actor runs


def test_a_shard_is_computed_stored_and_marked_done(worker, tmp_path):
    report = worker.compute_shard(1, attempt=2)
    assert (report["shard"], report["attempt"], report["rows"]) == (1, 2, 4)
    assert report["bytes"] > 0 and report["recomputed_rows"] == 0
    store = open_store(str(tmp_path / "s.zarr"))
    assert store.shard_done.tolist() == [False, True, False]
    config = worker.config
    want = per_class_gradients(
        build_model(config.model.factory, config.model.kwargs),
        build_probe(config.data.factory, config.data.kwargs),
        num_classes=C,
    )
    # Rows of classes 4..7 computed as one shard against all classes at once: the engine packs
    # samples by request, so float32 summation order may differ.
    np.testing.assert_allclose(store.rows(np.arange(4, 8)), want[4:8].numpy(), rtol=1e-5, atol=1e-7)


def test_a_shard_that_fails_midway_is_not_marked_done(worker, tmp_path):
    blocks = worker.engine.iter_blocks

    def fails_after_one_block(classes):
        it = blocks(classes)
        yield next(it)
        raise RuntimeError("device lost")

    worker.engine.iter_blocks = fails_after_one_block
    with pytest.raises(RuntimeError, match="device lost"):
        worker.compute_shard(0)
    assert not open_store(str(tmp_path / "s.zarr")).shard_done.any()


def test_a_run_that_lost_the_lease_does_not_mark_its_shard_done(tmp_path):
    config = config_for(tmp_path)
    prepare_store(config)
    open_store(config.store.url, mode="r+").lease.acquire("run-b")
    stale = GradientWorker(config.model_dump(mode="json"), run_id="run-a")
    with pytest.raises(LeaseHeldError, match=r"run 'run-a' no longer holds the lease .* shard 0 is not computed"):
        stale.compute_shard(0)
    assert not open_store(config.store.url).shard_done.any()
    assert open_store(config.store.url).shard_record(0) is None  # nothing started: no chunk, no record
    current = GradientWorker(config.model_dump(mode="json"), run_id="run-b")
    current.compute_shard(0)
    assert open_store(config.store.url).shard_done.tolist() == [True, False, False]


def counting_config(tmp_path) -> JobConfig:
    """``config_for``'s job over a Dataset that records each sample read (2 samples per class)."""
    raw = config_for(tmp_path).model_dump(mode="json")
    raw["data"] = {"factory": "tests.support.counting_data:counting_probe", "kwargs": {"num_classes": C}}
    return JobConfig.model_validate(raw)


def test_an_actor_given_the_drivers_targets_reads_only_its_shards_samples_and_hashes_none(tmp_path):
    from classgrad.service.driver_runtime.preparation import check_job
    from tests.support.counting_data import READS

    config = counting_config(tmp_path)
    READS.clear()
    checked = check_job(config)
    assert sorted(set(READS)) == list(range(2 * C))  # the driver reads (and hashes) every sample once
    prepared = prepare_store(config, checked=checked)
    READS.clear()
    worker = GradientWorker(
        config.model_dump(mode="json"),
        num_threads=1,
        identity=prepared.identity,
        probe_targets=checked.probe_targets,
    )
    assert set(READS) <= set(range(4))  # its first samples: the identity's outputs and reads_repeat
    assert worker.engine.probe.digest == prepared.identity["probe"]  # the driver's, not hashed again
    READS.clear()
    worker.compute_shard(1)  # classes 4..7: samples 8..15
    assert set(READS) == set(range(8, 16))
    # The same rows as an actor that read and hashed everything itself.
    alone = GradientWorker(config.model_dump(mode="json"), num_threads=1, identity=prepared.identity)
    rows = open_store(config.store.url).rows(np.arange(4, 8))
    alone.compute_shard(1)
    np.testing.assert_array_equal(open_store(config.store.url).rows(np.arange(4, 8)), rows)


def test_an_actor_whose_data_differs_from_the_drivers_is_refused_in_one_line(tmp_path, monkeypatch):
    from classgrad.errors import InputError
    from classgrad.service.driver_runtime.preparation import check_job
    from tests.support.counting_data import RELABEL

    config = counting_config(tmp_path)
    checked = check_job(config)
    prepared = prepare_store(config, checked=checked)
    monkeypatch.setenv(RELABEL, "9")  # this node's sample 9 has another label: found when read
    worker = GradientWorker(
        config.model_dump(mode="json"), num_threads=1, identity=prepared.identity, probe_targets=checked.probe_targets
    )
    worker.compute_shard(0)  # samples 0..7: as on the driver
    with pytest.raises(
        InputError, match=r"another probe set here than on the driver.*sample 9 has label 5 here, 4 on the driver$"
    ):
        worker.compute_shard(1)
    assert open_store(config.store.url).shard_done.tolist() == [True, False, False]
    # Another length: refused when the actor starts.
    with pytest.raises(InputError, match=r"24 samples here, 23 on the driver"):
        GradientWorker(
            config.model_dump(mode="json"),
            num_threads=1,
            identity=prepared.identity,
            probe_targets=checked.probe_targets[:23],
        )
