"""A cluster job whose store lives in object storage: an S3-compatible server on loopback (moto).

The Ray nodes (a head and one worker node, 1 CPU each, so the two actors run on different nodes)
get the credentials and the endpoint in their environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), as pods get them from a Kubernetes secret; the
job file names only ``s3://bucket/path``, and the submitting client has no credentials at all.
The driver creates the store on the head, the actors write their rows from both nodes, and this
test reads it back. Then it looks for the credentials everywhere they must not be: every object
of the store, the job's logs and entrypoint, the client's output.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import s3fs  # noqa: E402
import torch

from classgrad.store import open_store
from tests.support.cluster import LocalRayCluster
from tests.support.engine_cases import max_relative_error
from tests.support.harness import classgrad_cli, reference_rows

pytestmark = pytest.mark.slow  # a real two-node Ray cluster; deselect with -m "not slow"

CONFIG = "configs/cluster_s3.yaml"
JOB_TIMEOUT_S = 240
# Fresh, recognisable values per run: moto accepts any credentials, and a random secret cannot
# match anything in the store by chance.
KEY_ID = f"AKIACG{secrets.token_hex(7).upper()}"
SECRET = secrets.token_urlsafe(30)


@pytest.fixture(scope="module")
def s3_cluster(s3_server: str):
    env = {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with LocalRayCluster(workers=1, head_cpus=1, worker_cpus=1, env=env) as cluster:
        yield cluster


def test_s3_store_end_to_end_without_credentials_anywhere(s3_cluster, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/jobs/cluster_s3.zarr"
    # The submitting machine has no credentials: only the cluster's nodes do.
    client_env = {k: v for k, v in s3_cluster.client_env().items() if not k.startswith("AWS_")}
    r = classgrad_cli(
        "submit",
        CONFIG,
        "--address",
        s3_cluster.dashboard_url,
        "--follow",
        "--set",
        f"store.url={url}",
        env=client_env,
        timeout=JOB_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    job_id = r.stdout.splitlines()[0].strip()

    options = {"key": KEY_ID, "secret": SECRET, "client_kwargs": {"endpoint_url": s3_server}}
    store = open_store(url, storage_options=options)
    assert store.is_complete
    rows = torch.from_numpy(store.rows(np.arange(store.num_classes)))
    # float32 rows against the float64 reference: the engine contract (tests/unit/test_engines.py).
    assert max_relative_error(rows, reference_rows(CONFIG, [f"store.url={url}"])) <= 1e-6
    run = store.runs[-1]
    assert run["status"] == "complete" and len(set(run["nodes"])) == 2  # written from both nodes
    assert store.attrs["config"]["store"]["storage_options"] == {}

    # Not in any object of the store (chunks, metadata, run history, lease) ...
    fs = s3fs.S3FileSystem(**options)
    keys = fs.find(s3_bucket)
    assert len(keys) >= store.num_shards and any(k.endswith("zarr.json") for k in keys)
    for key in keys:
        data = fs.cat_file(key)
        for secret in (KEY_ID, SECRET, s3_server):
            assert secret.encode() not in data, (secret, key)
    # ... nor in what the driver printed (the job's logs), the job's record, or the client output.
    logs = classgrad_cli(
        "jobs", "logs", job_id, "--address", s3_cluster.dashboard_url, env=client_env, timeout=JOB_TIMEOUT_S
    )
    status = classgrad_cli(
        "jobs", "status", job_id, "--json", "--address", s3_cluster.dashboard_url, env=client_env, timeout=JOB_TIMEOUT_S
    )
    assert logs.returncode == 0 and "complete" in logs.stdout and '"SUCCEEDED"' in status.stdout
    for text in (logs.stdout, logs.stderr, status.stdout, r.stdout, r.stderr):
        assert KEY_ID not in text and SECRET not in text
