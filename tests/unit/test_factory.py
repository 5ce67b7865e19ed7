"""Building a job from its config (``classgrad.workers.actor_runtime.factory``): model by import path
(checkpoint loaded without pickle, mode), probe set, engine, the preflight check, and one-line
errors for bad factory paths."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from classgrad.config import JobConfig
from classgrad.errors import InputError
from classgrad.workers import zoo
from classgrad.workers.actor_runtime.factory import (
    build_job_engine,
    build_model,
    build_probe,
    load_checkpoint,
    preflight,
)
from tests.support.engine_cases import NUM_CLASSES

MLP = {"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": NUM_CLASSES, "in_features": 8, "hidden": 16}}
VECTORS = {
    "factory": "classgrad.workers.zoo:synthetic_probe",
    "kwargs": {"num_classes": NUM_CLASSES, "samples_per_class": 2, "kind": "vector", "input_shape": [8]},
}


def job(**sections) -> JobConfig:
    base = {"model": MLP, "data": VECTORS, "loss": {"num_classes": NUM_CLASSES}, "engine": {"device": "cpu"}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return JobConfig.model_validate(base)


def test_build_model_calls_the_factory_with_its_kwargs_in_the_mode_asked_for():
    model = build_model("classgrad.workers.zoo:mlp", {"num_classes": 5, "in_features": 3, "hidden": 7}, mode="train")
    assert model.training
    assert model(torch.zeros(2, 3)).shape == (2, 5)
    assert not build_model("classgrad.workers.zoo:mlp", {"num_classes": 5}).training  # eval by default


def test_build_probe_takes_the_factory_data_and_batch_size():
    probe = build_probe(VECTORS["factory"], VECTORS["kwargs"], batch_size=5)
    assert len(probe) == 2 * NUM_CLASSES and probe.batch_size == 5 and probe.num_micro_batches == 3


def test_job_engine_follows_the_config():
    config = job(
        engine={"kind": "dense", "block_rows": 2},
        loss={"kind": "logit"},
        params={"include": ["0.*"]},
        precision={"dtype": "bf16"},
        data={"batch_size": 4},
    )
    engine = build_job_engine(config)
    assert engine.name == "dense" and engine.block_rows == 2
    assert engine.loss.name == "logit" and engine.layout.names == ["0.weight", "0.bias"]
    assert engine.precision.dtype == "bf16" and engine.probe.batch_size == 4
    assert str(engine.device) == "cpu"
    assert build_job_engine(job()).name == "partitioned"  # auto, cross-entropy on an MLP


@pytest.mark.parametrize(
    "factory,kwargs,message",
    [
        ("classgrad.workers.zoo.mlp", {}, "model.factory 'classgrad.workers.zoo.mlp': expected 'module:function'"),
        ("classgrad.workers.nowhere:mlp", {}, "cannot import module 'classgrad.workers.nowhere'"),
        ("classgrad.workers.zoo:no_such_model", {}, "module 'classgrad.workers.zoo' has no attribute 'no_such_model'"),
        ("classgrad.workers.zoo:mlp", {"colour": 1}, "model.factory 'classgrad.workers.zoo:mlp' raised TypeError"),
        ("classgrad.workers.zoo:synthetic_probe", {}, "returned tuple, not an nn.Module"),
    ],
)
def test_bad_model_factories_are_one_line_errors(factory, kwargs, message):
    with pytest.raises(InputError, match=message) as info:
        build_model(factory, kwargs)
    assert "\n" not in str(info.value)


def test_bad_data_factory_is_named():
    with pytest.raises(InputError, match="data.factory 'classgrad.workers.zoo:nope': module"):
        build_probe("classgrad.workers.zoo:nope")


def test_preflight_refuses_a_model_that_cannot_take_the_data():
    engine = build_job_engine(job(model={"kwargs": {"num_classes": NUM_CLASSES, "in_features": 5}}))
    with pytest.raises(InputError, match="the model's forward failed on the probe data: RuntimeError"):
        preflight(engine)
    preflight(build_job_engine(job()))  # a sound job passes


def test_preflight_leaves_train_mode_batchnorm_statistics_as_built():
    from classgrad.workers.actor_runtime.identity import engine_identity

    bn = {"factory": "classgrad.workers.zoo:bn_cnn", "kwargs": {"num_classes": NUM_CLASSES}}
    images = {"kwargs": {**VECTORS["kwargs"], "kind": "image", "input_shape": [3, 8, 8]}}
    config = job(model={**bn, "mode": "train"}, data=images, engine={"kind": "dense"})
    engine = build_job_engine(config)
    before = engine_identity(engine).to_dict()
    preflight(engine)
    # The run's identity digests the buffers: the driver's build must stay the actors' build.
    assert engine_identity(engine).to_dict() == before


# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoints_load_from_torch_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    source = zoo.mlp(NUM_CLASSES, seed=7)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "w.pt")
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    for name in ("w.pt", "w.safetensors"):
        model = build_model("classgrad.workers.zoo:mlp", {"num_classes": NUM_CLASSES}, str(tmp_path / name), "eval")
        assert not model.training
        for a, b in zip(model.state_dict().values(), source.state_dict().values(), strict=True):
            assert torch.equal(a, b)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('CLASSGRAD_PWNED', '/nonexistent/pwned')}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_checkpoint_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("CLASSGRAD_PWNED", str(marker))
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"state_dict": _Payload()}))
    with pytest.raises(InputError, match="refused, not a plain weights file"):
        load_checkpoint(zoo.mlp(NUM_CLASSES), str(path))
    assert not marker.exists()


def test_checkpoint_that_does_not_fit_is_refused(tmp_path):
    torch.save(zoo.mlp(NUM_CLASSES, hidden=8).state_dict(), tmp_path / "w.pt")
    with pytest.raises(InputError, match="does not fit the model"):
        load_checkpoint(zoo.small_cnn(NUM_CLASSES), str(tmp_path / "w.pt"))
