"""Fixtures for integration tests that run jobs on a real local Ray.

- ``ray_local`` (module): ``ray.init`` with 2 CPUs on this machine, the repository root on the
  workers' PYTHONPATH (so ``tests.support.slow_models`` imports there), shut down after.
- ``job_config``: builds a small, fast job config (``tests.support.jobs.small_job``, overridden by
  section) whose store lives under tmp_path.

Running ``classgrad`` in a subprocess: ``tests.support.harness.classgrad_cli`` / ``start_cli``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from classgrad.config import JobConfig
from tests.support.harness import fresh_ray_auth_afterwards, repo_env
from tests.support.jobs import small_job


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


@pytest.fixture
def job_config(tmp_path):
    def make(**sections: Any) -> JobConfig:
        return JobConfig.model_validate(small_job(str(tmp_path / "store.zarr"), **sections))

    return make
