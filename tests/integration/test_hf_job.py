"""Hugging Face models and dict data through a real Ray job, with no wrapper (issue 16, item 3).

A ``BertForSequenceClassification`` on padded dict samples with an attention mask (from a
``Dataset``, a ``DataLoader`` and a stand-in for ``datasets.Dataset``), the rest of issue 16's
models (GPT-2, Llama, ViT, ResNet, an LSTM classifier, a LayerNorm MLP), and plain models that
return a ``ModelOutput`` or a tuple: rows within 1e-5 of the float64 reference, parameter names
the model's own, class names from ``config.id2label``. And a user's factory module in the
directory ``classgrad run`` runs from, with nothing on ``PYTHONPATH``: the working directory is
shipped to the actors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import per_class_gradients
from tests.support.engine_cases import max_relative_error
from tests.support.harness import kill_session

C = 8
HF = "tests.support.hf_jobs"
TEXT = {"kwargs": {"num_classes": C, "per_class": 2, "seed": 1}, "batch_size": 4}
BERT = {"factory": f"{HF}:job_bert", "kwargs": {"num_classes": C, "names": True}}
VECTORS = {"factory": f"{HF}:job_vector_rows", "kwargs": {"num_classes": C}, "batch_size": 5}

CASES = {
    "bert-dict-dataset": {"model": BERT, "data": {"factory": f"{HF}:job_text_rows", "collate": "pad", **TEXT}},
    "bert-dataloader": {"model": BERT, "data": {"factory": f"{HF}:job_text_loader", **TEXT}},
    "bert-hf-dataset": {"model": BERT, "data": {"factory": f"{HF}:job_hf_rows", "collate": "pad", **TEXT}},
    "model-output": {"model": {"factory": f"{HF}:job_output_mlp", "kwargs": {"num_classes": C}}, "data": VECTORS},
    "tuple-output": {
        "model": {"factory": f"{HF}:job_tuple_mlp", "kwargs": {"num_classes": C}, "output": 1},
        "data": VECTORS,
    },
}
# The rest of issue 16's table as users bring them (tests/support/hf_models.py: tiny configs).
TABLE = "tests.support.hf_models"
for _name, _builder in [
    ("gpt2", "tiny_gpt2"),
    ("llama", "tiny_llama"),
    ("vit", "tiny_vit"),
    ("resnet", "tiny_resnet"),
    ("lstm", "lstm_classifier"),
    ("ln_mlp", "layernorm_mlp"),
]:
    CASES[f"table-{_name}"] = {
        "model": {"factory": f"{TABLE}:{_builder}", "kwargs": {"num_classes": C}},
        "data": {
            "factory": f"{TABLE}:hf_probe",
            "kwargs": {"name": _name, "num_classes": C, "per_class": 2, "seed": 1},
            "batch_size": 6,
        },
    }


def reference_rows(config) -> torch.Tensor:
    model = build_model(config.model.factory, config.model.kwargs).double()
    d = config.data
    probe = build_probe(
        d.factory, d.kwargs, 4096, label_field=d.label_field, collate=d.collate, pad_values=d.pad_values
    )
    return per_class_gradients(model, probe, num_classes=C, engine="reference", output=config.model.output)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_job_on_hf_inputs_stores_the_reference_rows_under_the_models_own_names(job_config, name):
    case = CASES[name]
    config = job_config(
        model=case["model"],
        data=case["data"],
        loss={"num_classes": C},
        sharding={"shard_rows": 4},
        cluster={"num_workers": 1},
    )
    summary = JobDriver(config).run()
    store = open_store(config.store.url)
    assert summary.status == "complete" and store.is_complete
    rows = torch.from_numpy(store.rows(np.arange(C)))
    # fp32 rows against the float64 reference; attention and layer norm sum over more terms
    # than the engine tests' small models, hence 1e-5 rather than their 1e-6.
    assert max_relative_error(rows, reference_rows(config)) <= 1e-5
    names = [slot.name for slot in store.layout]
    if name.startswith("bert"):
        assert "classifier.weight" in names and "bert.embeddings.word_embeddings.weight" in names
        assert store.class_names == [f"class-{i}" for i in range(C)]
    elif name.startswith("table-"):  # the model's own names, in its own order
        model = build_model(config.model.factory, config.model.kwargs)
        assert names == [n for n, _ in model.named_parameters()]
    else:
        assert names == ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
        assert store.class_names is None


USER_MODULE = """
import torch
from torch import nn


def model(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, num_classes))


def data(num_classes):
    g = torch.Generator().manual_seed(1)
    return torch.randn(3 * num_classes, 4, generator=g), torch.arange(num_classes).repeat(3)
"""


def test_a_factory_module_in_the_working_directory_reaches_the_actors(tmp_path):
    """``classgrad run`` (the console script: the directory it runs from is not on ``sys.path``)
    from a directory holding the user's ``my_models.py``, with nothing on ``PYTHONPATH``."""
    (tmp_path / "my_models.py").write_text(textwrap.dedent(USER_MODULE))
    job = {
        "model": {"factory": "my_models:model", "kwargs": {"num_classes": C}},
        "data": {"factory": "my_models:data", "kwargs": {"num_classes": C}, "batch_size": 5},
        "loss": {"num_classes": C},
        "sharding": {"shard_rows": 4},
        "store": {"url": "out.zarr", "row_chunk": 2},  # relative: the actors run in a copy of the directory
        "cluster": {"num_workers": 2},
        "run": {"progress": "log"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    script = Path(sys.executable).parent / "classgrad"
    proc = subprocess.Popen(
        [str(script), "run", "job.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "shipping the working directory" in err, err[-3000:]
    store = open_store(str(tmp_path / "out.zarr"))
    assert store.is_complete
    sys.path.insert(0, str(tmp_path))
    try:
        import my_models  # type: ignore[import-not-found]

        ref = per_class_gradients(my_models.model(C).double(), my_models.data(C), num_classes=C, engine="reference")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_models", None)
    # fp32 rows of a small MLP against the float64 reference: the engine contract.
    assert max_relative_error(torch.from_numpy(store.rows(np.arange(C))), ref) <= 1e-6
