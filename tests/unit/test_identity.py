"""A run's identity (``classgrad.workers.actor_runtime.identity``): digests of the model as built and of the
probe set, the model's outputs on the first probe samples compared within a stated tolerance, the
refusal of a factory that is not deterministic, and the checks the driver and an actor make with
them (``check_identity`` in the driver, ``GradientWorker(identity=...)``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from classgrad.config import JobConfig
from classgrad.errors import InputError, StoreMismatchError
from classgrad.service.driver_runtime.preparation import check_identity, prepare_store
from classgrad.store import open_store
from classgrad.workers import zoo
from classgrad.workers.actor_runtime.actor import GradientWorker
from classgrad.workers.actor_runtime.factory import build_job_engine
from classgrad.workers.actor_runtime.identity import (
    OUTPUTS,
    PARAMS,
    PROBE,
    SKETCH_WIDTH,
    RunIdentity,
    check_same_build,
    engine_identity,
    identity_changes,
    model_digest,
)
from tests.support.stores import write_all

C = 12
MLP = {"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": C, "in_features": 6, "hidden": 8}}
DATA = {
    "factory": "classgrad.workers.zoo:synthetic_probe",
    "kwargs": {"num_classes": C, "samples_per_class": 2, "kind": "vector", "input_shape": [6], "seed": 3},
}


def job(tmp_path=None, **sections) -> JobConfig:
    base = {
        "model": MLP,
        "data": DATA,
        "loss": {"num_classes": C},
        "engine": {"device": "cpu"},
        "sharding": {"shard_rows": 4},
        "store": {"url": str(tmp_path / "s.zarr") if tmp_path else "unused.zarr", "row_chunk": 2},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return JobConfig.model_validate(base)


def identity_of(config: JobConfig) -> RunIdentity:
    return engine_identity(build_job_engine(config))


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A worker sets this process's torch thread count; later tests must not inherit it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_two_builds_of_one_config_have_the_same_identity():
    first, second = identity_of(job()), identity_of(job())
    assert first == second  # same weights, same data, same CPU arithmetic: exactly equal
    assert identity_changes(first.to_dict(), second) == []
    assert len(first.outputs) == 4 and len(first.outputs[0]) == C  # the first 4 samples, C logits each


def test_one_changed_weight_changes_the_parameter_digest():
    model = zoo.mlp(C, in_features=6, hidden=8)
    before = model_digest(model)
    with torch.no_grad():
        weight = model[0].weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))  # one ulp of one weight
    assert model_digest(model) != before


def test_a_changed_buffer_changes_the_parameter_digest():
    model = zoo.bn_cnn(C, width=4)
    before = model_digest(model)
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    bn.running_mean += 1e-3  # buffers, not parameters: still what the model computes with
    assert model_digest(model) != before


def test_other_weights_at_the_same_checkpoint_path_are_named(tmp_path):
    checkpoint = tmp_path / "latest.pt"
    torch.save(zoo.mlp(C, in_features=6, hidden=8, seed=0).state_dict(), checkpoint)
    config = job(model={"checkpoint": str(checkpoint)})
    before = identity_of(config)
    torch.save(zoo.mlp(C, in_features=6, hidden=8, seed=1).state_dict(), checkpoint)  # same path
    changed = identity_changes(before.to_dict(), identity_of(config))
    assert changed[0] == PARAMS and PROBE not in changed


def test_a_changed_forward_with_the_same_weights_is_named():
    scaled = {"factory": "tests.support.faulty:scaled_mlp", "kwargs": {**MLP["kwargs"], "scale": 1.5}}
    plain = identity_of(job())
    other = identity_of(job(model=scaled))
    assert other.params == plain.params  # scaled_mlp adds no parameter
    assert identity_changes(plain.to_dict(), other) == [OUTPUTS]


def test_changed_probe_data_is_named():
    other = {"kwargs": {**DATA["kwargs"], "seed": 4}}
    changed = identity_changes(identity_of(job()).to_dict(), identity_of(job(data=other)))
    assert PROBE in changed and PARAMS not in changed  # other samples also give other outputs


def test_outputs_are_compared_within_the_stated_tolerance():
    base = identity_of(job())

    def scaled_outputs(factor: float) -> RunIdentity:
        return dataclasses.replace(base, outputs=tuple(tuple(v * factor for v in row) for row in base.outputs))

    # 1e-3 relative: what a GPU with TF32 convolutions may differ from the driver's CPU; within
    # the float32 tolerance (1e-2), so the same inputs on another device are recognised.
    assert identity_changes(base.to_dict(), scaled_outputs(1 + 1e-3)) == []
    # 5% is a changed forward, not roundoff: above the float32 tolerance.
    assert identity_changes(base.to_dict(), scaled_outputs(1.05)) == [OUTPUTS]


def test_wide_outputs_are_recorded_as_a_sketch_that_keeps_their_norm():
    wide = 500
    config = job(
        model={"kwargs": {**MLP["kwargs"], "num_classes": wide}},
        data={"kwargs": {**DATA["kwargs"], "num_classes": wide, "samples_per_class": 1}},
        loss={"num_classes": wide},
    )
    engine = build_job_engine(config)
    identity = engine_identity(engine)
    assert identity.sketched and all(len(row) == SKETCH_WIDTH for row in identity.outputs)
    with torch.no_grad():
        x, _ = engine.probe.batch(torch.arange(4), engine.device)
        norms = torch.linalg.vector_norm(engine.model(x).double(), dim=1)
    sketch_norms = torch.linalg.vector_norm(torch.tensor(identity.outputs), dim=1)
    # A count sketch keeps each row's norm on average; 500 values into 64 buckets with fixed
    # signs stay within a factor of 2 of it (a loose bound: only its order of magnitude matters).
    assert ((sketch_norms / norms - 1).abs() < 0.5).all(), (sketch_norms, norms)
    assert identity_changes(identity.to_dict(), engine_identity(engine)) == []


def test_an_unseeded_factory_is_refused_with_the_seed_message():
    config = job(model={"factory": "tests.support.faulty:unseeded_mlp", "kwargs": {"num_classes": C, "in_features": 6}})
    driver, actor = identity_of(config), identity_of(config)  # two builds, as the driver's and an actor's
    with pytest.raises(InputError, match=r"not deterministic \(unseeded initialisation.*seed it") as err:
        check_same_build(driver.to_dict(), actor)
    assert "parameters/buffers" in str(err.value) and "\n" not in str(err.value)


def test_factories_run_from_a_fresh_seed_and_leave_the_callers_random_state_alone():
    config = job(model={"factory": "tests.support.faulty:unseeded_mlp", "kwargs": {"num_classes": C, "in_features": 6}})
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = identity_of(config)
    assert torch.equal(torch.get_rng_state(), state)  # zoo factories call torch.manual_seed: not seen here
    torch.manual_seed(0)
    # The same random state before each build, still other weights: an unseeded factory cannot
    # agree with itself by accident (as it would in two fresh processes, which start alike).
    assert identity_of(config).params != first.params


def test_random_transforms_in_the_probe_set_are_refused_with_the_seed_message():
    noisy = {"factory": "tests.support.faulty:noisy_dataset"}
    with pytest.raises(InputError, match=r"other inputs each time they are read \(random transforms\?\).*seed them"):
        identity_of(job(data=noisy))


def test_an_actor_whose_build_differs_from_the_drivers_refuses_to_start(tmp_path):
    unseeded = {"factory": "tests.support.faulty:unseeded_mlp", "kwargs": {"num_classes": C, "in_features": 6}}
    config = job(tmp_path, model=unseeded)
    prepared = prepare_store(config)
    with pytest.raises(InputError, match="seed it"):
        GradientWorker(config.model_dump(mode="json"), num_threads=1, identity=prepared.identity)
    assert not open_store(prepared.store.url).shard_done.any()


def test_an_actor_built_like_the_driver_starts_and_computes(tmp_path):
    config = job(tmp_path)
    prepared = prepare_store(config)
    worker = GradientWorker(config.model_dump(mode="json"), num_threads=1, identity=prepared.identity)
    assert worker.compute_shard(0)["rows"] == 4


def test_the_store_records_the_identity_and_the_driver_refuses_other_inputs_once_a_shard_is_done(tmp_path):
    checkpoint = tmp_path / "latest.pt"
    torch.save(zoo.mlp(C, in_features=6, hidden=8, seed=0).state_dict(), checkpoint)
    config = job(tmp_path, model={"checkpoint": str(checkpoint)})
    prepared = prepare_store(config)
    assert prepared.store.spec.identity == prepared.identity
    GradientWorker(config.model_dump(mode="json"), num_threads=1).compute_shard(1)

    torch.save(zoo.mlp(C, in_features=6, hidden=8, seed=1).state_dict(), checkpoint)  # same path
    again = prepare_store(config)  # the same config: the fingerprint cannot tell
    with pytest.raises(StoreMismatchError) as err:
        check_identity(again.store, again.identity)
    message = str(err.value)
    assert "\n" not in message
    assert "holds 1 done shards computed from other inputs: the model's parameters/buffers" in message
    assert "restore the inputs" in message and "store.overwrite=true" in message
    assert open_store(again.store.url).spec.identity == prepared.identity  # the record is kept


def test_a_store_with_no_done_shard_takes_the_new_identity(tmp_path):
    checkpoint = tmp_path / "latest.pt"
    torch.save(zoo.mlp(C, in_features=6, hidden=8, seed=0).state_dict(), checkpoint)
    config = job(tmp_path, model={"checkpoint": str(checkpoint)})
    first = prepare_store(config)
    torch.save(zoo.mlp(C, in_features=6, hidden=8, seed=1).state_dict(), checkpoint)
    again = prepare_store(config)
    check_identity(again.store, again.identity)  # nothing was computed from the old weights
    assert open_store(again.store.url).spec.identity == again.identity != first.identity


def test_a_store_recorded_without_identity_is_resumed_as_before(tmp_path):
    config = job(tmp_path)
    prepared = prepare_store(config)
    store = prepared.store
    # As a store made before identities were recorded reads (the attribute absent).
    store.record_identity(None)  # type: ignore[arg-type]
    store = open_store(store.url, mode="r+")
    assert store.spec.identity is None
    write_all(store, np.zeros((store.num_classes, store.dim), np.float32), shards=[0])  # rows, then the mark
    check_identity(store, prepared.identity)  # no record: nothing to compare, resumed as before
    assert np.asarray(store.shard_done)[0] == 1
