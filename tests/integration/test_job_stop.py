"""``classgrad jobs stop`` stops a driver that inherited SIGINT ignored (issue 29).

A Ray head started by a script in the background (``setsid ray start ... &``) starts with SIGINT
ignored, and so does every process it starts, the job's driver too: Ray Jobs' stop signal
(SIGINT, ``submit.STOP_ENV``) did nothing, the driver computed on until Ray's SIGKILL 30 s
later, recorded no run and left the store's lease behind, while ``jobs stop --wait`` said
"stopped". Here the whole cluster (one head node) starts with SIGINT ignored
(``LocalRayCluster(ignore_sigint=True)``), a slow job is submitted, and once it has saved a shard
``jobs stop --wait`` must return well before that SIGKILL, say the driver stopped itself, and
leave the run recorded as interrupted and the lease released.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from classgrad.store import open_store
from tests.support.cluster import LocalRayCluster
from tests.support.harness import classgrad_cli, shards_done, start_cli, wait_for

pytestmark = pytest.mark.slow  # a real Ray cluster with the job server

CONFIG = "configs/cluster_s3.yaml"
# One actor, one forward per class with 50 ms of sleep: 512 classes take ~26 s, ample time to stop it.
SLOW = [
    "model.factory=tests.support.slow_models:slow_mlp",
    "model.kwargs.delay_s=0.05",
    "data.batch_size=2",
    "params.include=[inner.2.*]",
    "cluster.num_workers=1",
]
RAY_SIGKILL_AFTER_S = 30  # submit.STOP_ENV's RAY_JOB_STOP_WAIT_TIME_S


def _sigint_ignored(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (2 - 1)))  # SIGINT is signal 2
    return False


def test_jobs_stop_stops_a_driver_that_inherited_sigint_ignored(tmp_path):
    with LocalRayCluster(workers=0, head_cpus=1, ignore_sigint=True) as cluster:
        assert _sigint_ignored(cluster.nodes[0].proc.pid)  # the scenario is real
        store = str(tmp_path / "stop.zarr")
        sets = [a for o in [*SLOW, f"store.url={store}"] for a in ("--set", o)]
        env = cluster.client_env()
        submit = start_cli("submit", CONFIG, "--address", cluster.dashboard_url, *sets, env=env)
        out, err = submit.communicate(timeout=120)
        assert submit.returncode == 0, err[-3000:]
        job_id = out.splitlines()[0].strip()
        wait_for(lambda: shards_done(store) >= 1, 150, "a shard saved")

        t0 = time.monotonic()
        stop = classgrad_cli("jobs", "stop", job_id, "--wait", "--address", cluster.dashboard_url, env=env, timeout=90)
        took = time.monotonic() - t0
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "stopped: its driver recorded the run as interrupted" in stop.stdout, stop.stdout
        # Ray kills a driver still running after 30 s: stopping before that means the driver
        # stopped on SIGINT itself. ``took`` also holds a new interpreter's start and the CLI's
        # polls (seconds on a loaded 2-core machine), so it is not held to less than the 30 s.
        assert took < RAY_SIGKILL_AFTER_S, took
        stopped = open_store(store)
        assert stopped.runs[-1]["status"] == "interrupted" and stopped.lease.info() is None
        assert int(stopped.shard_done.sum()) < stopped.num_shards
