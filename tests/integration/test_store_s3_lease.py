"""The store's lease and deletions on an S3-compatible endpoint (moto server on loopback, real HTTP).

- The lease object is created only if absent (``If-None-Match: *``) and replaced or deleted
  only if its ETag is unchanged (``If-Match``); a lost race is a refusal, not an overwrite.
- Of many takers of a new store's lease started together, exactly one gets it.
- An overwrite cut short (its marker next to the store, the group metadata and some chunks
  gone) is refused without overwrite and finished with it; other objects under the prefix stay.
- Leftover chunk objects with no group metadata (as after a lost bucket) are deleted with
  overwrite only; a store at a bucket's root keeps its lease under the root, apart from the store.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import s3fs

from classgrad.errors import LeaseHeldError, StoreError
from classgrad.store import StoreSpec, create_store, open_store, store_lease
from classgrad.store.integrity.lease_files import S3LeaseFile


def spec(fingerprint: str = "fp-1") -> StoreSpec:
    return StoreSpec(num_classes=16, dim=6, shard_rows=4, row_chunk=4, col_chunk=3, fingerprint=fingerprint)


def fill(store) -> None:
    for shard in range(store.num_shards):
        start, stop = store.shard_range(shard)
        store.write_rows(start, np.ones((stop - start, 6)), loss=np.ones(stop - start), count=np.ones(stop - start))
        store.mark_shard_done(shard)


def keys(fs: s3fs.S3FileSystem, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(k[len(prefix) + 1 :] for k in fs.find(prefix))


def test_the_s3_lease_object_is_written_only_under_its_conditions(s3_bucket, s3_storage_options):
    fs = s3fs.S3FileSystem(**s3_storage_options)
    file = S3LeaseFile(fs, f"{s3_bucket}/a.zarr.classgrad-lease.json")
    assert file.read() == (None, None)
    assert file.create(b"first") and not file.create(b"second")  # If-None-Match: *
    data, etag = file.read()
    assert data == b"first"
    assert file.replace(b"renewed", etag)
    assert not file.replace(b"stale", etag) and not file.delete(etag)  # If-Match with an old ETag
    assert file.read()[0] == b"renewed"
    assert file.delete(file.read()[1]) and file.read() == (None, None)


def race_for_lease(url: str, options: dict, n: int) -> list[str]:
    """n threads, released together, each taking the lease of ``url``; what each said."""
    barrier, said = threading.Barrier(n), [""] * n

    def take(i: int) -> None:
        lease = store_lease(url, storage_options=options)
        barrier.wait()
        try:
            lease.acquire(f"run-{i}", ttl_s=60.0)
            said[i] = "won"
        except LeaseHeldError:
            said[i] = "refused"

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return said


def test_of_many_takers_of_a_new_s3_store_exactly_one_gets_the_lease(s3_bucket, s3_storage_options):
    for trial in range(3):
        url = f"s3://{s3_bucket}/race-{trial}.zarr"
        said = race_for_lease(url, s3_storage_options, 6)
        assert said.count("won") == 1, said
        assert store_lease(url, storage_options=s3_storage_options).info()["run_id"] == f"run-{said.index('won')}"


def test_an_s3_overwrite_cut_short_is_finished_and_other_objects_stay(s3_bucket, s3_storage_options):
    url, prefix = f"s3://{s3_bucket}/jobs/s.zarr", f"{s3_bucket}/jobs/s.zarr"
    fs = s3fs.S3FileSystem(**s3_storage_options)
    with store_lease(url, storage_options=s3_storage_options).hold("run-a") as held:
        fill(create_store(url, spec(), storage_options=s3_storage_options, lease=held))
        fs.pipe_file(f"{prefix}/notes.txt", b"not the store's")
        # An overwrite that died after its marker, the group metadata and a few chunks.
        fs.pipe_file(f"{prefix}.classgrad-deleting", b'{"run_id": "run-a", "reason": "overwrite"}')
        fs.rm([f"{prefix}/zarr.json", f"{prefix}/grads/c/0/0", f"{prefix}/loss/c/0"])
    with pytest.raises(StoreError, match=r"was being deleted \(overwrite.*--set store.overwrite=true"):
        create_store(url, spec(), storage_options=s3_storage_options)
    new = create_store(url, spec("fp-2"), storage_options=s3_storage_options, overwrite=True)
    assert new.fingerprint == "fp-2" and not new.shard_done.any()
    assert not fs.exists(f"{prefix}.classgrad-deleting")
    assert fs.cat_file(f"{prefix}/notes.txt") == b"not the store's"
    assert row_chunks(fs, prefix) == []  # every old chunk of rows is gone


def row_chunks(fs, prefix: str) -> list[str]:
    """Chunk objects of the per-row arrays (a new store writes only its coordinate arrays'
    chunks, format 3: class ids, parameter table)."""
    return [
        k
        for k in keys(fs, prefix)
        if "/c/" in k and k.split("/")[0] in ("grads", "row_scale", "loss", "count", "shard_done")
    ]


def test_leftover_s3_chunks_are_deleted_with_overwrite_only(s3_bucket, s3_storage_options):
    url, prefix = f"s3://{s3_bucket}/lost.zarr", f"{s3_bucket}/lost.zarr"
    fs = s3fs.S3FileSystem(**s3_storage_options)
    fill(create_store(url, spec(), storage_options=s3_storage_options))
    fs.rm([f"{prefix}/{k}" for k in keys(fs, prefix) if k.endswith("zarr.json")])  # only chunks are left
    left = keys(fs, prefix)
    with pytest.raises(StoreError, match="holds chunks of a classgrad store but no store metadata"):
        create_store(url, spec(), storage_options=s3_storage_options)
    assert keys(fs, prefix) == left
    assert create_store(url, spec(), storage_options=s3_storage_options, overwrite=True).fingerprint == "fp-1"
    assert row_chunks(fs, prefix) == []


def test_a_store_at_a_bucket_root_keeps_its_lease_apart(s3_bucket, s3_storage_options):
    url = f"s3://{s3_bucket}"
    fs = s3fs.S3FileSystem(**s3_storage_options)
    with store_lease(url, storage_options=s3_storage_options).hold("run-a") as held:
        assert ".classgrad-lease.json" in keys(fs, s3_bucket)
        fill(create_store(url, spec(), storage_options=s3_storage_options, lease=held))
        create_store(url, spec("fp-2"), storage_options=s3_storage_options, overwrite=True, lease=held)
        assert open_store(url, storage_options=s3_storage_options).lease.info()["run_id"] == "run-a"
    assert ".classgrad-lease.json" not in keys(fs, s3_bucket)
