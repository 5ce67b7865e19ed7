"""A job whose S3 endpoint throttles every write: the first PUT of every object is answered
``503 SlowDown`` (``tests/support/slowdown.py``, an HTTP proxy in front of moto), as S3 answers
a prefix over its request rate. The client's own retries are off (botocore: one attempt), so
what rides it out is the store's backoff (``src/classgrad/store/core/retry.py``). The job (the
fault job's 12 shards on 2 actors, a sharded store) completes, every shard once, bit-identical
to an uninterrupted run on a local disk."""

from __future__ import annotations

import numpy as np
import pytest

from classgrad.config import JobConfig
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from tests.support.harness import assert_identical, fault_job, store_arrays, uninterrupted
from tests.support.slowdown import SlowDownProxy

pytestmark = pytest.mark.usefixtures("ray_local")

NUM_SHARDS = 12


@pytest.fixture
def proxy(s3_server):
    endpoint = SlowDownProxy(s3_server)
    yield endpoint
    endpoint.close()


@pytest.mark.timeout(300)
def test_a_job_backs_off_from_slowdown_on_every_write_and_completes(tmp_path, s3_bucket, proxy):
    options = {
        "key": "testing-key-id",
        "secret": "testing-secret-key",
        "client_kwargs": {"endpoint_url": proxy.endpoint},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }
    clean = uninterrupted(JobConfig.model_validate(fault_job(str(tmp_path / "clean.zarr"), store={"sharded": True})))
    url = f"s3://{s3_bucket}/throttled.zarr"
    config = JobConfig.model_validate(fault_job(url, store={"storage_options": options, "sharded": True}))
    driver = JobDriver(config)

    summary = driver.run()

    assert summary.status == "complete" and summary.shards_done == NUM_SHARDS
    assert dict(driver.completions) == {i: 1 for i in range(NUM_SHARDS)} and summary.retries == 0
    # Every object written was refused once: the shards' rows, records and marks, and the
    # store's own metadata and lease.
    assert proxy.refused >= NUM_SHARDS * 6, proxy.refused
    assert open_store(url, storage_options=options).verify_chunks() == []
    assert_identical(store_arrays(url, storage_options=options), clean)
    assert np.all(open_store(url, storage_options=options).shard_done)
