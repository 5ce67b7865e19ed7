"""Faults on a real multi-node Ray cluster on loopback: a shard that raises, a crashed node.

What ``test_job.py`` and ``test_cli_job.py`` already cover is not repeated here (an actor killed
mid-job on a local Ray, the driver SIGKILLed or interrupted and rerun, a gracefully stopped
node in ``test_cluster_jobs.py``). Here, on one ``LocalRayCluster`` for the module (a head and
two worker nodes, 1 CPU each, token auth on), with ``classgrad run --set cluster.address=...``
as the driver, in a subprocess, as a user runs it:

- a shard whose user code raises on its first two attempts succeeds on the third
  (``sharding.max_attempts: 3``), and the summary counts the two retries;
- with ``max_attempts: 2`` the job fails in one line naming the shard, every other shard is
  saved, and a rerun computes only that shard;
- a worker node that crashes mid-job (SIGKILL of its whole process group: raylet, agents and
  the actor with it) while the job's 3 actors take every CPU of the cluster: no spare capacity is
  left, so the replacement actor never starts, and the job finishes on the 2 actors left (before
  the dispatcher sent shards only to ready actors, the lost actor's shards waited for that
  replacement: the run hung).

The module also checks, on its cluster, that the dashboard and job server listen on 127.0.0.1
only and that nothing the cluster listens on serves HTTP to a client without the token (a
safety check of ``test_safety.py``'s list, here to share the cluster).

Every job ends with every row present exactly once (each shard completed once, by the run
history's counts) and rows, losses and counts bit-identical to an uninterrupted run of the same
job (``harness.uninterrupted``: the same worker code in this process, same engine, same CPU
arithmetic). Faults come from ``tests/support/faulty.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from classgrad.config import JobConfig
from classgrad.store import open_store
from tests.support import faulty
from tests.support.cluster import LocalRayCluster
from tests.support.harness import (
    LOOPBACK,
    REPO,
    WILDCARD,
    assert_identical,
    classgrad_cli,
    error_lines,
    fault_job,
    job_api_without_token,
    kill_session,
    listening,
    ray_processes,
    shards_done,
    start_cli,
    store_arrays,
    uninterrupted,
    wait_for,
    write_job,
)

NUM_SHARDS = 12  # 48 classes, shards of 4 rows
FAIL_CLASS = 9  # in shard 2 (rows 8-11); not among the 4 samples the driver's preflight uses
FAIL_SHARD = FAIL_CLASS // 4
JOB_TIMEOUT_S = 180

# Fast node-death detection: the GCS declares a node dead after 5 missed 1 s health checks
# (Ray's default is about 15 s or more), so a crashed node is noticed within seconds. Not
# tighter: on a loaded 2-core machine a healthy node must never miss 5 in a row.
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 5}


@pytest.fixture(scope="module")
def cluster():
    with LocalRayCluster(
        workers=2, head_cpus=1, worker_cpus=1, env={"PYTHONPATH": str(REPO)}, system_config=HEALTH
    ) as c:
        yield c


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, np.ndarray]:
    """Rows, losses and counts of an uninterrupted run of ``fault_job``."""
    url = str(tmp_path_factory.mktemp("clean") / "clean.zarr")
    return uninterrupted(JobConfig.model_validate(fault_job(url)))


def run_on(cluster: LocalRayCluster, config: str, *extra: str):
    return classgrad_cli(
        "run",
        config,
        "--set",
        f"cluster.address={cluster.gcs_address}",
        *extra,
        env=cluster.client_env(),
        timeout=JOB_TIMEOUT_S,
    )


def last_run(url: str) -> dict:
    return open_store(url).runs[-1]


def test_a_shard_that_raises_twice_succeeds_on_its_third_attempt(cluster, clean, tmp_path):
    plan = faulty.write_plan(tmp_path / "faults", fail_class=FAIL_CLASS, fail_times=2)
    url = str(tmp_path / "retry.zarr")
    config = write_job(tmp_path / "retry.yaml", fault_job(url, plan, sharding={"max_attempts": 3}))

    proc = run_on(cluster, config)

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert faulty.faults_raised(plan) == 2
    assert "faults      2 shard retries, 0 actors replaced" in proc.stdout
    run = last_run(url)
    assert run["status"] == "complete" and run["retries"] == 2 and run["actors_replaced"] == 0
    # Every shard completed exactly once in this run (a second completion would count twice).
    assert run["shards_done"] == NUM_SHARDS and run["shards_skipped"] == 0
    assert "shard 2 (rows 8-11) failed (attempt 1 of 3)" in proc.stderr
    assert "shard 2 (rows 8-11) failed (attempt 2 of 3)" in proc.stderr
    assert_identical(store_arrays(url), clean)


def test_a_shard_out_of_attempts_fails_the_job_naming_it_and_keeps_the_rest(cluster, clean, tmp_path):
    plan = faulty.write_plan(tmp_path / "faults", fail_class=FAIL_CLASS, fail_times=2)
    url = str(tmp_path / "fail.zarr")
    config = write_job(tmp_path / "fail.yaml", fault_job(url, plan, sharding={"max_attempts": 2}))

    proc = run_on(cluster, config)

    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert line.startswith(
        "classgrad: error: shard 2 (rows 8-11) failed 2 times: InjectedFault: injected fault while computing class 9"
    ), line
    assert f"{NUM_SHARDS - 1} of {NUM_SHARDS} shards are saved, rerun to resume" in line
    store = open_store(url)
    # Everything else was finished and saved before the job gave up (DESIGN.md, data flow 5).
    assert store.shard_done.tolist() == [i != FAIL_SHARD for i in range(NUM_SHARDS)]
    assert store.lease.info() is None, "a failed run must release its lease"
    run = last_run(url)
    assert run["status"] == "failed" and "shard 2 (rows 8-11) failed 2 times" in run["error"]
    assert run["shards_done"] == NUM_SHARDS - 1
    saved = np.flatnonzero(np.repeat(store.shard_done, 4))
    np.testing.assert_array_equal(store.rows(saved), clean["rows"][saved])

    # The plan's two faults are spent: the rerun computes only the failed shard.
    rerun = run_on(cluster, config)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    run = last_run(url)
    assert run["shards_done"] == 1 and run["shards_skipped"] == NUM_SHARDS - 1 and run["retries"] == 0
    assert_identical(store_arrays(url), clean)


def test_the_dashboard_and_job_server_listen_on_loopback_only(cluster):
    # A safety check (test_safety.py), here because it needs the cluster this module starts.
    sockets = listening(ray_processes(*[node.proc.pid for node in cluster.alive_nodes()]))
    dashboard = [ip for ip, port, _ in sockets if port == cluster.dashboard_port]
    assert dashboard and all(ip in LOOPBACK for ip in dashboard), dashboard
    assert job_api_without_token(cluster.dashboard_port) == "refused (401)"
    # Nothing else serves HTTP to a client without the token (Prometheus exporters aside).
    answers = {port: job_api_without_token(port) for ip, port, _ in sockets if ip in LOOPBACK + WILDCARD}
    assert not [port for port, answer in answers.items() if answer.startswith("SERVED")], answers


def test_a_crashed_worker_node_with_no_spare_capacity_loses_no_rows_and_finishes_on_the_rest(cluster, clean, tmp_path):
    # Runs last: it takes a node away from the module's cluster. The plan's gate is open until
    # 2 shards are done, then closed: every actor waits inside a loss call with its shard in
    # flight, so the crash surely lands on one, however long a loaded machine takes to find it.
    # 3 actors of 1 CPU on the cluster's 3 CPUs: the crashed node's replacement can never start.
    plan = faulty.write_plan(tmp_path / "faults", delay_s=0.15, hold=True)
    faulty.release(plan)
    url = str(tmp_path / "crash.zarr")
    config = write_job(tmp_path / "crash.yaml", fault_job(url, plan, cluster={"num_workers": 3}))
    proc = start_cli("run", config, "--set", f"cluster.address={cluster.gcs_address}", env=cluster.client_env())
    try:
        wait_for(lambda: shards_done(url) >= 2, 120, "2 shards done", alive=proc)
        faulty.hold(plan)
        # Never the head (the GCS lives there); a worker node that hosts one of our actors.
        actors = wait_for(
            lambda: {n: i for n, i in cluster.actor_nodes("classgrad-").items() if i != 0},
            30,
            "an actor on a worker node",
        )
        victim = sorted(actors.values())[0]
        cluster.stop_node(victim, force=True)
        done_at_crash = shards_done(url)
        faulty.release(plan)
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        faulty.release(plan)
        kill_session(proc)

    assert proc.returncode == 0, err[-3000:]
    assert done_at_crash < NUM_SHARDS, "the job ended before the crash: make it slower"
    run = last_run(url)
    assert run["status"] == "complete" and run["actors_replaced"] >= 1 and run["retries"] >= 1, run
    assert run["shards_done"] == NUM_SHARDS and run["shards_skipped"] == 0
    assert_identical(store_arrays(url), clean)
    assert re.search(r"actor \d+ died \(", err), err[-3000:]  # the loss was seen, and said in one line
