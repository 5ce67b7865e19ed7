"""A run that lost the store never lands rows in the store that replaced it (issue 45, item 1).

Real processes, no mocks: job A (a slow MLP, ``run.lease_ttl_s`` 5 s, two actors, its own local
Ray) is paused (SIGSTOP of its driver and of every process of its Ray) once it has marked two
shards done; job B (another model seed, ``store.overwrite: true``, its own Ray) takes over the
stale lease, creates the store again and finishes; then A is resumed (SIGCONT). Whatever A's
actors write afterwards is never read as B's: every shard reads as B's uninterrupted rows, or is
refused in one line naming it (its chunks unlike B's records, or its record written for A's
creation of the store); A's run is not appended to B's history; ``classgrad verify --repair``
then unmarks what A touched, a rerun of B's job recomputes it, and the store verifies and holds
B's rows exactly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

from classgrad.config import JobConfig
from classgrad.errors import CorruptChunkError
from classgrad.service.analysis.verify import CORRUPT, verify_store
from classgrad.store import open_store
from classgrad.store.core.format import LEASE_LOCK_SUFFIX
from tests.support.harness import (
    classgrad_cli,
    kill_session,
    ray_processes,
    repo_env,
    shards_done,
    start_cli,
    uninterrupted,
    wait_for,
    write_job,
)
from tests.support.jobs import small_job


def job(url: str, seed: int, **extra) -> dict:
    sections = {
        "model": {
            "factory": "tests.support.slow_models:slow_mlp",
            "kwargs": {"num_classes": 48, "delay_s": 0.3, "in_features": 8, "hidden": 16, "seed": seed},
        },
        "data": {
            "kwargs": {"num_classes": 48, "samples_per_class": 3, "kind": "vector", "input_shape": [8], "seed": 2}
        },
        "run": {"lease_ttl_s": 5.0, "progress": "log", "log_every_s": 1.0},
    }
    for name, values in extra.items():
        sections[name] = {**sections.get(name, {}), **values}
    return small_job(url, **sections)


@pytest.fixture
def ray_dirs():
    """Two short private Ray temp dirs (Unix socket paths must stay under ~107 bytes)."""
    dirs = [tempfile.mkdtemp(prefix=f"cgfence{i}-", dir="/tmp") for i in (0, 1)]
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def lease_lock(url: str) -> Iterator[None]:
    """The lock a driver holds while it renews the lease of the local store at ``url``. A process
    suspended while the test holds it was not inside a renewal: one suspended inside would keep
    the lock, and B would wait on it until A resumed, which the test does only after B."""
    fd = os.open(url + LEASE_LOCK_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def env_with(ray_tmp: str) -> dict[str, str]:
    base = {k: v for k, v in repo_env().items() if not k.startswith("RAY_")}
    return {**base, "RAY_TMPDIR": ray_tmp}


def test_a_paused_run_never_lands_rows_in_the_store_that_replaced_it(tmp_path, ray_dirs):
    import psutil

    url = str(tmp_path / "s.zarr")
    path_a = write_job(tmp_path / "a.yaml", job(url, seed=0))
    b = job(url, seed=1, store={"overwrite": True})
    path_b = write_job(tmp_path / "b.yaml", b)
    want = uninterrupted(JobConfig.model_validate(job(str(tmp_path / "ref.zarr"), seed=1)))["rows"]

    a = start_cli("run", path_a, env=env_with(ray_dirs[0]), output=tmp_path / "a")
    paused: list = []
    try:
        wait_for(lambda: shards_done(url) >= 2, 180, "job A: 2 shards done", alive=a)
        paused = [psutil.Process(a.pid), *ray_processes(a.pid, marker=ray_dirs[0])]
        with lease_lock(url):
            for p in paused:
                p.suspend()
        time.sleep(7)  # past A's lease TTL (5 s): its lease is stale, its processes alive
        b_run = classgrad_cli("run", path_b, env=env_with(ray_dirs[1]), timeout=300)
        assert b_run.returncode == 0, b_run.stderr[-3000:]
        assert "took over" in b_run.stderr or "stale" in b_run.stderr, b_run.stderr[-3000:]
        history = [r["run_id"] for r in open_store(url).runs]
        for p in paused:
            p.resume()
        paused = []
        a.wait(timeout=120)
        assert a.returncode != 0  # A lost its lease
    finally:
        for p in paused:
            p.resume()
        kill_session(a)

    store = open_store(url)
    assert [r["run_id"] for r in store.runs] == history  # A's run is not in B's history
    refused = []
    for shard in range(store.num_shards):
        rows = np.arange(*store.shard_range(shard))
        try:
            got = store.rows(rows)
        except CorruptChunkError as exc:
            assert f"shard {shard}" in str(exc) and "\n" not in str(exc)
            refused.append(shard)
            continue
        np.testing.assert_array_equal(got, want[rows], err_msg=f"shard {shard} reads as another run's rows")
    # What readers refused, verify finds; --repair unmarks those shards (a resume compares sizes
    # from one listing, not bytes: A's chunks have the sizes of B's) and the rerun recomputes them.
    report = verify_store(url, repair=True)
    assert report.code in (0, CORRUPT) and bool(refused) == bool(report.code)
    assert set(refused) <= set(report.repaired)
    rerun = classgrad_cli("run", path_b, env=env_with(ray_dirs[1]), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert verify_store(url).code == 0
    np.testing.assert_array_equal(open_store(url).rows(np.arange(48)), want)
