"""``classgrad run`` as a user runs it: a subprocess with its own local Ray.

Killing the driver (SIGKILL) or pressing Ctrl-C (SIGINT) mid-job loses nothing: a rerun of the
same command skips the shards already done and ends with rows identical to an uninterrupted
run. A bad config fails in one line with no store left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import yaml

from classgrad.store import open_store
from tests.support.harness import (
    classgrad_cli,
    kill_session,
    shards_done,
    start_cli,
    wait_for,
)
from tests.support.jobs import small_job

SLOW = {
    "model": {
        "factory": "tests.support.slow_models:slow_mlp",
        "kwargs": {"num_classes": 48, "delay_s": 0.3, "in_features": 8, "hidden": 16},
    },
    "data": {"kwargs": {"num_classes": 48, "samples_per_class": 3, "kind": "vector", "input_shape": [8], "seed": 2}},
}


def write_config(tmp_path, name: str, **sections) -> tuple[str, str]:
    url = str(tmp_path / f"{name}.zarr")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(url, **sections)))
    return str(path), url


def settled_shards_done(url: str, quiet_s: float = 3.0, timeout: float = 60.0) -> int:
    """Shards done once no new one has appeared for ``quiet_s`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = shards_done(url), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "shards kept appearing after the driver died"
        time.sleep(0.2)
        now = shards_done(url)
        if now != last:
            last, since = now, time.monotonic()
    return last


def run_to_end(config: str) -> subprocess.CompletedProcess:
    proc = classgrad_cli("run", config, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The local Ray it starts keeps token auth on without Ray's warning on every run (issue 29).
    assert "Token authentication is enabled" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> np.ndarray:
    tmp = tmp_path_factory.mktemp("clean")
    config, url = write_config(tmp, "clean", **SLOW)
    run_to_end(config)
    return open_store(url).rows(np.arange(48))


def test_sigkill_driver_then_rerun_skips_done_shards(tmp_path, uninterrupted):
    config, url = write_config(tmp_path, "killed", **SLOW)
    # A session of its own (start_cli), so kill_session removes the local Ray the driver started.
    proc = start_cli("run", config)
    try:
        wait_for(lambda: shards_done(url) >= 3, 120, "3 shards done", alive=proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_session(proc)
    # Ray's actor processes have sessions of their own and may finish the shard they were
    # computing just after the driver died: count the done shards once that has settled.
    done_before = settled_shards_done(url)
    store = open_store(url)
    assert 3 <= done_before < store.num_shards

    rerun = run_to_end(config)
    store = open_store(url)
    last = store.runs[-1]
    assert store.is_complete and last["status"] == "complete"
    # The rerun computed only what was missing: done shards were skipped, not recomputed.
    assert last["shards_skipped"] == done_before
    assert last["shards_done"] == store.num_shards - done_before
    assert f"{store.num_shards - done_before} computed, {done_before} already done" in rerun.stdout
    np.testing.assert_array_equal(store.rows(np.arange(48)), uninterrupted)


def test_ctrl_c_stops_cleanly_and_the_rerun_finishes(tmp_path, uninterrupted):
    config, url = write_config(tmp_path, "interrupted", **SLOW)
    proc = start_cli("run", config)
    try:
        wait_for(lambda: shards_done(url) >= 2, 120, "2 shards done", alive=proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_session(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; finished shards are saved" in err and "Traceback" not in err
    store = open_store(url)
    last = store.runs[-1]
    assert last["status"] == "interrupted"
    # What the record says the run saved is what the store holds (issue 45, item 10: it counted
    # only the shards whose reports the driver had read).
    assert last["rows"] == int(store.shard_done.sum()) * store.shard_rows
    assert store.lease.info() is None, "an interrupted run must release its lease"
    run_to_end(config)
    np.testing.assert_array_equal(open_store(url).rows(np.arange(48)), uninterrupted)


@pytest.mark.parametrize(
    "sections,message",
    [
        ({"loss": {"kind": "cross_entropy", "num_clases": 48}}, "loss.num_clases: unknown key"),
        (
            {"model": {"kwargs": {"num_classes": 47, "width": 4}}},
            r"model output has shape (4, 47), expected (batch, 48)",
        ),
    ],
)
def test_bad_config_prints_one_line_and_creates_no_store(tmp_path, sections, message):
    config, url = write_config(tmp_path, "bad", **sections)
    proc = classgrad_cli("run", config, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "classgrad:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(url)
