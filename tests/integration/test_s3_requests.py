"""Requests per shard on object storage (issue 55: at 1,000 actors with 3-s shards every request
counts, and S3 takes 3,500 PUTs a second per prefix), counted from moto's own request log.

A 256-row shard at k = 4,096 columns, written as an actor writes it: the lease read before it
starts, the rows, the lease read before the mark, the shard's record and its done mark. With
``store.sharded`` it is at most 10 requests of every kind together, with no existence check (a
GET, HEAD or LIST of an object) before a write; unsharded it is a PUT per chunk of each array.
"""

from __future__ import annotations

import collections

import numpy as np

from classgrad.store import StoreSpec, create_store, open_store

K = 4096
SHARD_ROWS = 256


def _write_one_shard(url: str, options: dict, *, sharded: bool, s3_requests) -> collections.Counter:
    spec = StoreSpec(num_classes=2 * SHARD_ROWS, dim=K, shard_rows=SHARD_ROWS, row_chunk=16, sharded=sharded)
    create_store(url, spec, storage_options=options)
    store = open_store(url, storage_options=options, mode="r+")
    lease = store.lease
    s3_requests.mark()
    lease.info()  # the actor's lease check before the shard (workers/actor_runtime/actor.py)
    rows = np.random.default_rng(0).standard_normal((SHARD_ROWS, K), dtype=np.float32)
    store.write_rows(SHARD_ROWS, rows, loss=np.zeros(SHARD_ROWS), count=np.ones(SHARD_ROWS, np.int64))
    lease.info()  # and before its mark
    store.mark_shard_done(1)
    requests = s3_requests.since_mark()
    assert open_store(url, storage_options=options).shard_done.tolist() == [False, True]
    return collections.Counter(method for method, _ in requests), requests


def test_a_sharded_shard_costs_at_most_10_requests_and_no_read_before_a_write(
    s3_bucket, s3_storage_options, s3_requests
):
    counts, requests = _write_one_shard(
        f"s3://{s3_bucket}/sharded.zarr", s3_storage_options, sharded=True, s3_requests=s3_requests
    )
    assert sum(counts.values()) <= 10, requests
    reads = [(m, p) for m, p in requests if m in ("GET", "HEAD") and "classgrad-lease" not in p]
    assert not reads, reads  # no existence check of an object before it is written
    assert counts["PUT"] == 6, requests  # grads, row_scale, loss, count objects, the record, the mark


def test_an_unsharded_shard_costs_a_put_per_chunk(s3_bucket, s3_storage_options, s3_requests):
    counts, requests = _write_one_shard(
        f"s3://{s3_bucket}/plain.zarr", s3_storage_options, sharded=False, s3_requests=s3_requests
    )
    chunks = SHARD_ROWS // 16
    assert counts["PUT"] == 4 * chunks + 2, requests  # 4 arrays x 16 row chunks, the record, the mark
    assert counts["GET"] == 2 and counts["HEAD"] == 0, requests  # the two lease reads only
