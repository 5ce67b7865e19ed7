"""Fixtures for integration tests that run jobs on a real local Ray.

- ``ray_local`` (module): ``ray.init`` with 2 CPUs on this machine, the repository root on the
  workers' PYTHONPATH (so ``tests.integration.slow_models`` imports there), shut down after.
- ``job_config``: builds a small, fast job config (a dict of overrides on top of defaults) whose
  store lives under tmp_path.

Running ``classgrad`` in a subprocess: ``harness.classgrad_cli`` / ``harness.start_cli``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from classgrad.service.config import JobConfig
from tests.integration.harness import fresh_ray_auth_afterwards, repo_env


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray in this process for the module. Its teardown also leaves this process's Ray
    auth state as a new process would find it (``harness.fresh_ray_auth_afterwards``, around
    ``ray.init`` and ``ray.shutdown``), so later modules find no stale token: a module that starts
    Ray in this process only through this fixture needs no fixture of its own for that."""
    import ray

    old = os.environ.get("PYTHONPATH")
    os.environ.update(repo_env({"PYTHONPATH": old or ""}))
    with fresh_ray_auth_afterwards():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        try:
            yield ray
        finally:
            ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def small_job(store_url: str, **sections: Any) -> dict:
    """A job of 48 classes on a small CNN, 12 shards of 4 rows, 2 actors; override by section."""
    base: dict[str, Any] = {
        "model": {"factory": "classgrad.workers.zoo:small_cnn", "kwargs": {"num_classes": 48, "width": 4}},
        "data": {"factory": "classgrad.workers.zoo:synthetic_probe",
                 "kwargs": {"num_classes": 48, "samples_per_class": 3, "imbalance": 1.0, "empty_classes": [5],
                            "input_shape": [3, 8, 8], "seed": 2},
                 "batch_size": 16},
        "loss": {"kind": "cross_entropy", "num_classes": 48},
        "sharding": {"shard_rows": 4},
        "store": {"url": store_url, "row_chunk": 2},
        "cluster": {"num_workers": 2, "num_cpus_per_worker": 1},
        "run": {"progress": "log", "log_every_s": 1.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


@pytest.fixture
def job_config(tmp_path):
    def make(**sections: Any) -> JobConfig:
        return JobConfig.model_validate(small_job(str(tmp_path / "store.zarr"), **sections))

    return make
