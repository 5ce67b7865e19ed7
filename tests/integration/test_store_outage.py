"""A job whose S3 endpoint goes down mid-job: retried in the store, then as a shard, then failed.

The store lives on the moto server (loopback, real HTTP) behind ``OutageProxy``
(``tests/support/outage.py``), which the test takes down once a few shards are done: open
connections are cut and new ones refused, as when the endpoint restarts; moto keeps every
object meanwhile. The job is ``harness.fault_job`` (12 shards of 4 rows, 2 actors, on a local
Ray in this process) with a small delay per class, so that the outage surely falls mid-job.
The client's own retries are turned off (botocore: one attempt; s3fs never retries a refused
connection), so that what these tests see is classgrad's: the store's retries of a request
(``src/classgrad/store/core/retry.py``), then the driver's retries of the shard (``sharding.max_attempts``).

- An outage of a few seconds: the job completes, every shard once, rows, losses and counts
  bit-identical to an uninterrupted run.
- An endpoint that stays down: the job fails after the shard attempts, in one line naming a
  shard and the last error; every shard done before the outage stays done, and a rerun once the
  endpoint is back computes only the others, ending bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from classgrad.config import JobConfig
from classgrad.errors import ShardFailedError
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from tests.support import faulty
from tests.support.harness import assert_identical, fault_job, store_arrays, uninterrupted
from tests.support.outage import OutageProxy

pytestmark = pytest.mark.usefixtures("ray_local")

NUM_SHARDS = 12
# Longer than what today's client rides out alone (no retries: it fails at the first refused
# connection), shorter than the store's retries of a request (3.75 s of waits at most) plus the
# shard's next attempts.
OUTAGE_S = 3.0
DELAY_S = 0.05  # per class: 0.2 s per shard, so 12 shards take a few seconds


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, np.ndarray]:
    """Rows, losses and counts of an uninterrupted run of the job, on a local disk."""
    url = str(tmp_path_factory.mktemp("clean") / "clean.zarr")
    return uninterrupted(JobConfig.model_validate(fault_job(url)))


@pytest.fixture
def proxy(s3_server):
    endpoint = OutageProxy(s3_server)
    with endpoint.running():
        yield endpoint


def outage_job(tmp_path, bucket: str, proxy: OutageProxy, **sections) -> JobConfig:
    options = {
        "key": "testing-key-id",
        "secret": "testing-secret-key",
        "client_kwargs": {"endpoint_url": proxy.endpoint},
        "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
    }
    plan = faulty.write_plan(tmp_path / "faults", delay_s=DELAY_S)
    job = fault_job(f"s3://{bucket}/outage.zarr", plan, store={"storage_options": options}, **sections)
    return JobConfig.model_validate(job)


def take_down_when(driver: JobDriver, proxy: OutageProxy, shards_done: int, up_after_s: float | None) -> dict:
    """Take the endpoint down once ``shards_done`` shards are done (back after ``up_after_s``,
    or never); the returned dict gets what the driver had done then, and when it came back."""
    seen: dict = {}

    def watch() -> None:
        # Counted from before the driver starts its actors (a minute, on a loaded machine); never
        # taken down at another moment than the planned one: the test then fails on ``seen``.
        deadline = time.monotonic() + 100
        while driver.summary.shards_done < shards_done:
            if time.monotonic() > deadline or driver.summary.status != "running":
                return
            time.sleep(0.01)
        proxy.down()
        seen["done_at_outage"] = driver.summary.shards_done
        if up_after_s is not None:
            time.sleep(up_after_s)
            proxy.up()
            seen["back_at"] = time.monotonic()

    threading.Thread(target=watch, daemon=True).start()
    return seen


@pytest.mark.timeout(120)
def test_a_job_rides_out_an_endpoint_that_goes_down_for_a_few_seconds(tmp_path, s3_bucket, proxy, clean):
    config = outage_job(tmp_path, s3_bucket, proxy)
    driver = JobDriver(config)
    seen = take_down_when(driver, proxy, 3, up_after_s=OUTAGE_S)

    summary = driver.run()

    assert summary.status == "complete" and summary.shards_done == NUM_SHARDS
    # The outage fell mid-job: shards were left to write when it began, and the job could end
    # only after it (the writes of those shards waited for the endpoint).
    assert seen["done_at_outage"] < NUM_SHARDS and time.monotonic() > seen["back_at"]
    assert dict(driver.completions) == {i: 1 for i in range(NUM_SHARDS)}  # each shard stored once
    url, options = config.store.url, config.store.storage_options
    assert open_store(url, storage_options=options).verify_chunks() == []
    assert_identical(store_arrays(url, storage_options=options), clean)
    # store.sharded left unset: a new store on S3 is sharded (its clean twin on a disk is not).
    assert open_store(url, storage_options=options).spec.sharded and "sharded" not in config.store.model_fields_set


@pytest.mark.timeout(150)
def test_an_endpoint_that_stays_down_fails_the_job_after_the_shard_attempts_and_keeps_the_rest(
    tmp_path, s3_bucket, proxy, clean
):
    config = outage_job(tmp_path, s3_bucket, proxy, sharding={"max_attempts": 2})
    driver = JobDriver(config)
    # At 9 done, one actor still has a shard waiting behind the one it computes: that one surely
    # meets the outage.
    seen = take_down_when(driver, proxy, 9, up_after_s=None)

    with pytest.raises(ShardFailedError) as info:
        driver.run()

    message = str(info.value)
    assert "\n" not in message
    match = re.match(
        r"shard (\d+) \(rows (\d+)-(\d+)\) failed 2 times: StoreUnavailableError: cannot .* "
        r"still failing after \d+ tries in [\d.]+ s: .*; (\d+) of 12 shards are saved, rerun to resume",
        message,
    )
    assert match, message
    shard, saved = int(match[1]), int(match[4])
    assert 0 <= shard < NUM_SHARDS and seen["done_at_outage"] <= saved < NUM_SHARDS

    proxy.up()
    url, options = config.store.url, config.store.storage_options
    store = open_store(url, storage_options=options, mode="r+")
    done = store.shard_done
    # Every shard reported done is kept. A few more may be marked done too (at most one per actor):
    # a mark whose PUT reached the store as the endpoint went down, its answer lost, so that its
    # actor reported a failure (seen in CI). Its rows were written before its mark, so it is whole:
    # the rerun below skips it and the final store still equals an uninterrupted run.
    kept = int(done.sum())
    assert saved <= kept <= saved + config.cluster.num_workers, (saved, done)
    # The driver could not release its lease while the endpoint was down (it logged that); a rerun
    # in another process takes over a lease whose holder is gone, but its holder here is this
    # process, which lives on: release it as that takeover would.
    assert store.lease.info()["run_id"] == driver.run_id
    store.lease.release(driver.run_id)
    rerun = JobDriver(config)
    summary = rerun.run()
    assert summary.status == "complete" and summary.shards_skipped == kept
    assert set(rerun.completions) == set(np.flatnonzero(~done.astype(bool)).tolist())  # only the rest
    assert_identical(store_arrays(url, storage_options=options), clean)
