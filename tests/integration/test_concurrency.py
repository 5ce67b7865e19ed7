"""Two drivers, one store: the store's lease lets one run at a time, and a stale one go.

- While a driver runs, a second ``classgrad run`` of the same job is refused in one line that
  names the running run (its id, host and pid), also when the second asks for a much shorter
  ``run.lease_ttl_s``: staleness is judged by the holder's TTL, the promise it renews by.
- A lease whose holder stopped renewing (a driver that hangs: alive, so the dead-pid shortcut
  of ``store.lease.acquire`` cannot apply) is refused while fresh and taken over, with a
  warning, once its TTL has passed; the job then completes and releases the lease.
- Whoever takes a stale lease over promises its own TTL (checked on the store's API alone).

The two jobs end with rows bit-identical to an uninterrupted run (``harness.uninterrupted``).
They run in this process on the module's local Ray (``ray_local``); the second driver is the
real CLI entry point (``classgrad.service.commands.cli.main``), which fails at the lease, before it touches Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from classgrad.config import JobConfig
from classgrad.errors import LeaseHeldError
from classgrad.service.commands.cli import main as cli_main
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.service.driver_runtime.preparation import prepare_store
from classgrad.store import open_store
from tests.support.harness import (
    assert_identical,
    error_lines,
    shards_done,
    store_arrays,
    uninterrupted,
    wait_for,
    write_job,
)
from tests.support.jobs import small_job

pytestmark = pytest.mark.usefixtures("ray_local")

MLP = {
    "model": {"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": 48, "in_features": 8, "hidden": 16}},
    "data": {
        "kwargs": {
            "num_classes": 48,
            "samples_per_class": 3,
            "kind": "vector",
            "input_shape": [8],
            "empty_classes": [5],
            "seed": 2,
        }
    },
}
# The same MLP, 0.15 s per forward: the first driver holds the store for several seconds.
SLOW = {
    **MLP,
    "model": {
        "factory": "tests.support.slow_models:slow_mlp",
        "kwargs": {"num_classes": 48, "delay_s": 0.15, "in_features": 8, "hidden": 16},
    },
}


def refused_line(capsys, argv: list[str]) -> str:
    code = cli_main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    (line,) = error_lines(err)
    return line


def test_a_second_driver_is_refused_naming_the_first_run(tmp_path, capsys):
    url = str(tmp_path / "store.zarr")
    # A long TTL: the first driver renews a third of it at a time, so its heartbeat stays the one
    # from before its actors started (a default 60 s TTL renews every 20 s, and actors that took
    # that long to start on a loaded machine renewed it just as the first shard landed).
    job = small_job(url, **SLOW, run={"lease_ttl_s": 600})
    path = write_job(tmp_path / "job.yaml", job)
    first = JobDriver(JobConfig.model_validate(job))
    outcome: dict = {}

    def run_first() -> None:
        try:
            outcome["summary"] = first.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    thread = threading.Thread(target=run_first, name="first-driver")
    thread.start()
    try:
        wait_for(lambda: shards_done(url) >= 1 or "error" in outcome, 120, "the first driver's first shard")
        lease = open_store(url).lease.info()
        assert lease is not None and lease["run_id"] == first.run_id
        # A second driver of the same job, then one with the shortest lease allowed (5 s): the
        # holder's TTL, not the newcomer's, says when a lease is stale.
        for extra in ([], ["--set", "run.lease_ttl_s=5"]):
            line = refused_line(capsys, ["run", path, *extra])
            assert f"is in use by run '{first.run_id}' (host {socket.gethostname()}, pid {os.getpid()}" in line, line
            assert shards_done(url) < 12, "the first driver finished before the check: make it slower"
    finally:
        thread.join(timeout=180)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"].status == "complete"
    store = open_store(url)
    # Only the first run is in the history: the refused drivers wrote nothing.
    assert [r["run_id"] for r in store.runs] == [first.run_id]
    assert store.lease.info() is None
    clean = JobConfig.model_validate(small_job(str(tmp_path / "clean.zarr"), **SLOW))
    assert_identical(store_arrays(url), uninterrupted(clean))


def test_a_stale_lease_is_taken_over_after_its_ttl(tmp_path, capsys, caplog):
    url = str(tmp_path / "store.zarr")
    job = small_job(url, **MLP)
    path = write_job(tmp_path / "job.yaml", job)
    config = JobConfig.model_validate(job)
    # A driver that took the store and then hung: it never renews its 2 s lease.
    store = prepare_store(config).store
    store.lease.acquire("hung-run", ttl_s=2.0, info={"host": socket.gethostname(), "pid": os.getpid()})
    heartbeat = store.lease.info()["heartbeat"]

    line = refused_line(capsys, ["run", path])
    assert "is in use by run 'hung-run'" in line, line

    wait_for(lambda: time.time() - heartbeat > 2.0, 10, "the hung run's lease to pass its TTL")
    caplog.set_level(logging.WARNING, logger="classgrad.store")
    assert cli_main(["run", path]) == 0, capsys.readouterr().err[-3000:]
    assert "taking over the stale lease of run 'hung-run'" in caplog.text
    assert "last heartbeat" in caplog.text and "> 2s" in caplog.text
    after = open_store(url)
    assert after.lease.info() is None and after.runs[-1]["status"] == "complete"
    clean = JobConfig.model_validate(small_job(str(tmp_path / "clean.zarr"), **MLP))
    assert_identical(store_arrays(url), uninterrupted(clean))


def test_a_lease_is_judged_by_its_holders_ttl(tmp_path):
    # The store's lease alone (no Ray): whoever takes a stale lease over promises its own TTL,
    # and that promise, not a newcomer's impatience, decides when the lease is stale again.
    config = JobConfig.model_validate(small_job(str(tmp_path / "store.zarr"), **MLP))
    store = prepare_store(config).store
    store.lease.acquire("quick-run", ttl_s=0.2)
    heartbeat = store.lease.info()["heartbeat"]
    wait_for(lambda: time.time() - heartbeat > 0.2, 5, "the quick run's lease to pass its TTL")
    other = open_store(config.store.url, mode="r+")
    other.lease.acquire("patient-run", ttl_s=60.0)
    assert other.lease.info()["run_id"] == "patient-run" and other.lease.info()["ttl_s"] == 60.0
    # A third driver that would call anything older than 0.2 s stale is still refused.
    third = open_store(config.store.url, mode="r+")
    wait_for(lambda: time.time() - third.lease.info()["heartbeat"] > 0.2, 5, "a heartbeat older than 0.2 s")
    with pytest.raises(LeaseHeldError, match="in use by run 'patient-run'"):
        third.lease.acquire("impatient-run", ttl_s=0.2)
