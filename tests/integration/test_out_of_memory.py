"""Actors that Ray's memory monitor kills are replaced, their shards requeued (issue 29).

A node out of memory used to end the job as ``classgrad: internal error: OutOfMemoryError`` with
some 40 lines of Ray's text, stored in the run record and printed by every ``status``: Ray fails
the tasks of an actor its memory monitor killed with ``ray.exceptions.OutOfMemoryError``, which
is not a ``RayActorError``. Here a local Ray for the module runs with a memory monitor threshold
just above what this machine uses now (``faulty.oom_threshold``: 2 GiB more crosses it, sampled
every 100 ms), and the fault plan makes an actor take memory, 64 MiB at a time, while it computes
a given class, until the monitor kills it: a real OOM kill, Ray's own exit and error, no mock.

- killed once: the job completes, one actor replaced, the shard requeued and computed once, the
  rows bit-identical to an uninterrupted run, no error in the record, one warning line that says
  "out of memory" (never Ray's dump);
- memory stays short (every attempt is killed): after the bounded replacements the job stops with
  one line that says memory stayed short, stored as that line, and ``classgrad status`` prints it
  as one line.

The jobs run with one actor, so the monitor's choice of worker is never in doubt.
"""

from __future__ import annotations

import logging
import os

import pytest

from classgrad.config import JobConfig
from classgrad.errors import ClassgradError
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from tests.support import faulty
from tests.support.harness import (
    assert_identical,
    classgrad_cli,
    fault_job,
    fresh_ray_auth_afterwards,
    repo_env,
    store_arrays,
    uninterrupted,
)

# Memory the monitor tolerates above this machine's use when the module starts, before it kills:
# 2 GiB, so that other processes' ups and downs on a shared machine rarely cross it (when they
# do, more actors are killed and replaced: the first test allows for that).
MARGIN = 2 << 30
HOG_MAX = 4 << 30  # what a hogging actor takes at most (the monitor kills it long before)
FAIL_CLASS = 9  # in shard 2 (rows 8-11); not among the driver's preflight samples


@pytest.fixture(scope="module")
def ray_tight():
    import ray

    old = os.environ.get("PYTHONPATH")
    os.environ.update(repo_env({"PYTHONPATH": old or ""}))
    with fresh_ray_auth_afterwards():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            logging_level="WARNING",
            _system_config={"memory_usage_threshold": faulty.oom_threshold(MARGIN), "memory_monitor_refresh_ms": 100},
        )
        try:
            yield ray
        finally:
            ray.shutdown()
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


def _job(tmp_path, name: str, max_attempts: int = 2, **plan) -> JobConfig:
    faults = faulty.write_plan(tmp_path / f"{name}-faults", oom_max_bytes=HOG_MAX, **plan)
    sharding = {"max_attempts": max_attempts}
    return JobConfig.model_validate(
        fault_job(str(tmp_path / f"{name}.zarr"), faults, cluster={"num_workers": 1}, sharding=sharding)
    )


def test_an_actor_killed_for_memory_is_replaced_and_its_shard_requeued(ray_tight, tmp_path, caplog):
    config = _job(tmp_path, "once", oom_class=FAIL_CLASS, oom_times=1)
    with caplog.at_level(logging.WARNING, logger="classgrad"):
        driver = JobDriver(config)
        summary = driver.run()
    assert faulty.memory_faults(tmp_path / "once-faults") == 1
    assert summary.status == "complete" and summary.error is None, summary
    assert summary.actors_replaced >= 1 and summary.retries >= 1
    assert sorted(driver.completions) == list(range(12)) and set(driver.completions.values()) == {1}
    oom = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(oom) == summary.actors_replaced, oom  # one line per kill
    assert all("\n" not in line and "Top 10" not in line and "memory monitor killed the actor" in line for line in oom)
    run = open_store(config.store.url).runs[-1]
    assert run["status"] == "complete" and run["error"] is None and run["actors_replaced"] == summary.actors_replaced
    clean = config.model_copy(update={"store": config.store.model_copy(update={"url": str(tmp_path / "clean.zarr")})})
    # Same shards, same engine, same CPU arithmetic: the requeued shard's rows are the same bits.
    assert_identical(store_arrays(config.store.url), uninterrupted(clean))


def test_memory_that_stays_short_stops_the_job_with_one_line(ray_tight, tmp_path):
    # Every attempt is killed; one attempt per shard and one replacement per actor: the second
    # kill is past the bound (cluster.num_workers x sharding.max_attempts replacements).
    config = _job(tmp_path, "short", max_attempts=1, oom_class=-1, oom_times=100)
    with pytest.raises(ClassgradError, match=r"out of memory: .*memory stayed short") as caught:
        JobDriver(config).run()
    line = str(caught.value)
    assert "\n" not in line and "Top 10" not in line and "rerun to resume" in line, line
    run = open_store(config.store.url).runs[-1]
    assert run["status"] == "failed" and run["error"] == line
    status = classgrad_cli("status", config.store.url, timeout=120)
    errors = [ln for ln in status.stdout.splitlines() if "error:" in ln]
    assert status.returncode == 0 and len(errors) == 1 and "memory stayed short" in errors[0], status.stdout
    assert "Top 10" not in status.stdout
