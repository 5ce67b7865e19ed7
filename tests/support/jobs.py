"""Small job configs for tests.

Holds ``small_job``: the dict of a fast job (48 classes, small CNN, 12 shards, 2 actors) whose
sections a test overrides one by one; ``mlp_job`` (a 24-class MLP job on vectors, three shards,
as a ``JobConfig``) and ``run_without_ray`` (the driver's preparation, then the real worker for
every shard, in this process), for unit tests of what a job stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from classgrad.config import JobConfig

MLP_JOB_CLASSES = 24


def small_job(store_url: str, **sections: Any) -> dict:
    """A job of 48 classes on a small CNN, 12 shards of 4 rows, 2 actors; override by section."""
    base: dict[str, Any] = {
        "model": {"factory": "classgrad.workers.zoo:small_cnn", "kwargs": {"num_classes": 48, "width": 4}},
        "data": {
            "factory": "classgrad.workers.zoo:synthetic_probe",
            "kwargs": {
                "num_classes": 48,
                "samples_per_class": 3,
                "imbalance": 1.0,
                "empty_classes": [5],
                "input_shape": [3, 8, 8],
                "seed": 2,
            },
            "batch_size": 16,
        },
        "loss": {"kind": "cross_entropy", "num_classes": 48},
        "sharding": {"shard_rows": 4},
        "store": {"url": store_url, "row_chunk": 2},
        "cluster": {"num_workers": 2, "num_cpus_per_worker": 1},
        "run": {"progress": "log", "log_every_s": 1.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


def mlp_job(tmp_path: Path, **sections: Any) -> JobConfig:
    """A job of 24 classes on a small MLP over 8-wide vectors, shards of 8 rows in chunks of 4, its
    store in ``tmp_path``; override by section."""
    C = MLP_JOB_CLASSES
    base: dict[str, Any] = {
        "model": {"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": C, "in_features": 8, "hidden": 16}},
        "data": {
            "factory": "classgrad.workers.zoo:synthetic_probe",
            "kwargs": {"num_classes": C, "samples_per_class": 3, "kind": "vector", "input_shape": [8]},
        },
        "loss": {"num_classes": C},
        "sharding": {"shard_rows": 8},
        "store": {"url": str(tmp_path / "s.zarr"), "row_chunk": 4},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return JobConfig.model_validate(base)


def run_without_ray(config: JobConfig):
    """The driver's preparation, then the real worker for every shard (no Ray): the store."""
    from classgrad.service.driver_runtime.preparation import prepare_store
    from classgrad.store import open_store
    from classgrad.workers.actor_runtime.actor import GradientWorker

    prepared = prepare_store(config)
    worker = GradientWorker(config.model_dump(mode="json"))
    for shard in prepared.shards:
        worker.compute_shard(shard.index)
    return open_store(config.store.url)
