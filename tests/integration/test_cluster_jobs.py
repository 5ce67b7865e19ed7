"""Jobs on a real multi-node Ray cluster on loopback: submission, stop and resume, spreading,
auth, errors, a lost node.

One cluster for the whole module (``LocalRayCluster``: a head with 1 CPU and two worker nodes
with 1 CPU each, token auth on). A job asks for 2 actors of 1 CPU, so they must land on two
different nodes. The job file is ``configs/cluster_s3.yaml`` (512 classes, small MLP) with its
store moved to a local absolute path, which every node of this one-machine cluster shares; the
stop and fault tests slow it down (``SLOW``) so that they can act in the middle of it.

The fault test stops a worker node and so runs last (pytest keeps file order).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from classgrad.errors import StoreError
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.cluster import LocalRayCluster, free_port
from tests.support.engine_cases import max_relative_error
from tests.support.harness import REPO, classgrad_cli, reference_rows, start_cli

pytestmark = pytest.mark.slow  # real multi-node Ray clusters; deselect with -m "not slow"

CONFIG = "configs/cluster_s3.yaml"
JOB_TIMEOUT_S = 240
# The slow variant for the fault test: one forward per class (batch of 2 = one class's samples)
# and 50 ms of sleep per forward, so 512 classes take ~13 s on each of 2 actors.
SLOW = [
    "model.factory=tests.support.slow_models:slow_mlp",
    "model.kwargs.delay_s=0.05",
    "data.batch_size=2",
    "params.include=[inner.2.*]",
]


@pytest.fixture(scope="module")
def cluster():
    with LocalRayCluster(workers=2, head_cpus=1, worker_cpus=1) as c:
        yield c


def check_store(url: str, overrides: list[str]) -> dict:
    """The store is complete, its rows equal the reference engine's; returns its last run."""
    store = open_store(url)
    assert store.is_complete and store.shard_done.all()
    rows = torch.from_numpy(store.rows(np.arange(store.num_classes)))
    # float32 rows against the float64 reference: the engine contract (tests/unit/test_engines.py).
    assert max_relative_error(rows, reference_rows(CONFIG, overrides)) <= 1e-6
    run = store.runs[-1]
    assert run["status"] == "complete"
    return run


def in_process_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout, and the error line (the last line of stderr; log lines may precede it)."""
    code = cli_main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    return code, out, lines[-1] + "\n" if lines else ""


def test_submit_stop_and_resubmit_resumes_with_actors_on_two_nodes(cluster, tmp_path):
    store = str(tmp_path / "cli.zarr")
    overrides = [*SLOW, f"store.url={store}"]
    sets = [a for o in overrides for a in ("--set", o)]
    env = cluster.client_env()
    # Our CLI runs from the repository root (harness.start_cli / classgrad_cli): the working dir it uploads.
    first = start_cli("submit", CONFIG, "--address", cluster.dashboard_url, *sets, env=env)
    try:
        _wait_for_progress(store, 2, None)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    job_id = out.splitlines()[0].strip()
    assert job_id.startswith("raysubmit_")

    # `jobs stop` reaches the driver as SIGINT (service/submit.py STOP_ENV): it records the run
    # as interrupted and releases the store's lease before Ray's SIGKILL.
    stop = classgrad_cli("jobs", "stop", job_id, "--wait", "--address", cluster.dashboard_url, env=env, timeout=90)
    assert stop.returncode == 0 and "stopped: its driver recorded the run" in stop.stdout, stop.stdout + stop.stderr
    status = classgrad_cli("jobs", "status", job_id, "--json", "--address", cluster.dashboard_url, env=env, timeout=60)
    assert status.returncode == 0 and '"status": "STOPPED"' in status.stdout, status.stdout + status.stderr
    # The entrypoint is the module form, joining the cluster it runs in (see service/submit.py).
    assert f"python -m classgrad run {CONFIG}" in status.stdout and "cluster.address=auto" in status.stdout
    stopped = open_store(store)
    assert stopped.runs[-1]["status"] == "interrupted" and stopped.lease.info() is None
    done_at_stop = int(stopped.shard_done.sum())
    assert 2 <= done_at_stop < stopped.num_shards

    # The same command again resumes: done shards are skipped, the rest computed on two nodes.
    again = classgrad_cli(
        "submit", CONFIG, "--address", cluster.dashboard_url, "--follow", *sets, env=env, timeout=JOB_TIMEOUT_S
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert ": complete" in again.stdout
    run = check_store(store, overrides)
    assert run["shards_skipped"] == done_at_stop and run["shards_done"] == stopped.num_shards - done_at_stop
    nodes = set(run["nodes"])
    assert len(nodes) == 2 and nodes <= set(cluster.node_ids().values()), (nodes, cluster.node_ids())


def test_ray_job_submit_runs_the_same_job(cluster, tmp_path):
    store = str(tmp_path / "ray.zarr")
    job_id = f"cg-ray-{uuid.uuid4().hex[:8]}"
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # Ray's own client needs RAY_AUTH_MODE=token and the token (cluster.client_env gives both).
    r = subprocess.run(
        [
            ray_cli,
            "job",
            "submit",
            "--address",
            cluster.dashboard_url,
            "--submission-id",
            job_id,
            "--working-dir",
            str(REPO),
            "--",
            "python",
            "-m",
            "classgrad",
            "run",
            CONFIG,
            "--set",
            f"store.url={store}",
            "--set",
            "cluster.address=auto",
        ],
        cwd=REPO,
        env=cluster.client_env(),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = classgrad_cli(
        "jobs", "status", job_id, "--address", cluster.dashboard_url, env=cluster.client_env(), timeout=60
    )
    assert status.returncode == 0 and f"job         {job_id}: SUCCEEDED" in status.stdout, status.stdout
    run = check_store(store, [f"store.url={store}"])
    assert len(set(run["nodes"])) == 2


def test_clients_without_the_token_are_refused(cluster, tmp_path, monkeypatch, capsys):
    # The job server itself: no token -> 401, wrong token -> 403 (listing and submitting alike).
    for method, data in (("GET", None), ("POST", b"{}")):
        request = urllib.request.Request(f"{cluster.dashboard_url}/api/jobs/", data=data, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 401
    request = urllib.request.Request(
        f"{cluster.dashboard_url}/api/jobs/", headers={"Authorization": "Bearer not-the-token"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 403

    # Our CLI, in this process: one line and exit 2, no traceback.
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
    code, out, err = in_process_cli(
        ["submit", CONFIG, "--address", cluster.dashboard_url, "--set", f"store.url={tmp_path / 'never.zarr'}"], capsys
    )
    assert code == 2 and out == "" and err.startswith("classgrad: error: "), err
    assert "refused the request: no auth token was sent" in err
    assert not (tmp_path / "never.zarr").exists()

    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    code, _, err = in_process_cli(["jobs", "list", "--address", cluster.dashboard_url], capsys)
    assert code == 2 and "rejected our token" in err and err.startswith("classgrad: error: "), err

    # With the token: an unknown job id, and an address where nothing listens.
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
    for action in ("status", "logs", "stop"):
        code, _, err = in_process_cli(["jobs", action, "no-such-job", "--address", cluster.dashboard_url], capsys)
        assert code == 2 and "no job 'no-such-job'" in err and err.startswith("classgrad: error: "), (action, err)
    code, _, err = in_process_cli(["jobs", "list", "--address", f"127.0.0.1:{free_port()}"], capsys)
    assert (
        code == 2
        and "cannot reach the Ray job server at http://127.0.0.1:" in err
        and err.startswith("classgrad: error: ")
    ), err
    code, out, _ = in_process_cli(["jobs", "list", "--address", cluster.dashboard_url], capsys)
    assert code == 0 and "SUCCEEDED" in out


def test_a_failing_job_exits_3_with_its_own_error_line(cluster, tmp_path):
    # The factory's syntax is valid (checked locally), the module exists nowhere (found remotely).
    r = classgrad_cli(
        "submit",
        CONFIG,
        "--address",
        cluster.dashboard_url,
        "--follow",
        "--set",
        f"store.url={tmp_path / 'bad.zarr'}",
        "--set",
        "model.factory=no_such_module:net",
        env=cluster.client_env(),
        timeout=JOB_TIMEOUT_S,
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 3 and last.startswith("classgrad: error: job raysubmit_"), r.stderr[-2000:]
    assert " FAILED: classgrad: error: " in last and "no_such_module" in last, last
    assert not (tmp_path / "bad.zarr").exists()  # the driver refused before creating the store


def _wait_for_progress(url: str, shards: int, proc: subprocess.Popen | None, timeout_s: float = 120) -> int:
    """Wait until the job's store has ``shards`` shards done; returns how many it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"the job ended early: {proc.communicate()}"
        try:
            done = int(open_store(url).shard_done.sum())
            if done >= shards:
                return done
        except StoreError:
            pass  # not created yet
        time.sleep(0.2)
    raise AssertionError(f"no {shards} shards done within {timeout_s} s")


def test_a_stopped_worker_node_mid_job_still_gives_a_complete_correct_store(cluster, tmp_path):
    store = str(tmp_path / "fault.zarr")
    overrides = [*SLOW, f"store.url={store}"]
    proc = start_cli(
        "submit",
        CONFIG,
        "--address",
        cluster.dashboard_url,
        "--follow",
        *[a for o in overrides for a in ("--set", o)],
        env=cluster.client_env(),
    )
    try:
        done_before = _wait_for_progress(store, 3, proc)
        actors = cluster.actor_nodes("classgrad-")
        victims = sorted({i for i in actors.values() if i != 0})  # never the head: the driver runs there
        assert victims, f"no actor on a worker node: {actors}"
        victim_id = cluster.node_ids()[victims[0]]
        state = open_store(store)
        done_at_stop = int(state.shard_done.sum())
        cluster.stop_node(victims[0])
        assert done_before <= done_at_stop < state.num_shards, "the job ended before the node stopped: slow it down"
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]

    run = check_store(store, overrides)
    # The lost actor's shards were requeued and a replacement started elsewhere.
    assert run["actors_replaced"] >= 1 and run["retries"] >= 1, run
    assert victim_id in run["nodes"] and len(set(run["nodes"])) >= 2, (victim_id, run["nodes"])
    assert os.path.isdir(store)
