"""The gradient store on an S3-compatible endpoint (moto server on loopback, real HTTP)."""

from __future__ import annotations

import numpy as np
import pytest
import s3fs  # noqa: E402

from classgrad.errors import StoreError, StoreMismatchError
from classgrad.store import ParamSlot, StoreSpec, create_store, open_store


def spec(**kw) -> StoreSpec:
    base = dict(
        num_classes=40,
        dim=24,
        shard_rows=16,
        row_chunk=8,
        col_chunk=10,
        layout=(ParamSlot("w", (4, 4), 0, 16), ParamSlot("b", (8,), 16, 8)),
        fingerprint="fp-s3",
    )
    base.update(kw)
    return StoreSpec(**base)


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_s3_round_trip_without_credentials_in_the_store(s3_bucket, s3_storage_options, sharded):
    url = f"s3://{s3_bucket}/jobs/demo.zarr"
    rows = np.random.default_rng(0).standard_normal((40, 24)).astype(np.float32)
    store = create_store(url, spec(sharded=sharded, dtype="float16", codec="zstd"), storage_options=s3_storage_options)
    for shard in range(store.num_shards):
        start, stop = store.shard_range(shard)
        store.write_rows(start, rows[start:stop], loss=np.ones(stop - start), count=np.ones(stop - start))
        store.mark_shard_done(shard)
    store.lease.acquire("run-1")
    store.append_run({"rows": 40})

    reader = open_store(url, storage_options=s3_storage_options)
    assert reader.is_complete and reader.verify_chunks() == []
    out = reader.rows(range(40))
    # float16 with row scaling: within half an ulp at the top of each row (2**-11 of its max).
    assert (np.abs(out - rows).max(axis=1) <= 2.0**-11 * np.abs(rows).max(axis=1)).all()
    assert reader.param("w", [3]).shape == (1, 4, 4)
    assert np.array_equal(reader.to_dask().compute(), out)  # the same decoding, exactly

    # Storage options (credentials, endpoint) are never written into the store.
    fs = s3fs.S3FileSystem(**s3_storage_options)
    keys = fs.find(f"{s3_bucket}/jobs/")
    assert f"{s3_bucket}/jobs/demo.zarr.classgrad-lease.json" in keys  # next to the store, not in it
    for key in keys:
        if key.endswith(".json"):
            text = fs.cat_file(key).decode()
            assert s3_storage_options["key"] not in text
            assert s3_storage_options["secret"] not in text
            assert s3_storage_options["client_kwargs"]["endpoint_url"] not in text
    store.lease.release("run-1")
    fs.invalidate_cache()
    assert not fs.exists(f"{s3_bucket}/jobs/demo.zarr.classgrad-lease.json")

    # Same fingerprint reopens; another is refused.
    assert create_store(
        url, spec(sharded=sharded, dtype="float16", codec="zstd"), storage_options=s3_storage_options
    ).is_complete
    with pytest.raises(StoreMismatchError):
        create_store(url, spec(fingerprint="other"), storage_options=s3_storage_options)


def test_s3_overwrite(s3_bucket, s3_storage_options):
    url = f"s3://{s3_bucket}/ow.zarr"
    store = create_store(url, spec(), storage_options=s3_storage_options)
    store.write_rows(0, np.ones((16, 24)), loss=np.ones(16), count=np.ones(16))
    store.mark_shard_done(0)
    new = create_store(url, spec(fingerprint="v2"), storage_options=s3_storage_options, overwrite=True)
    assert new.fingerprint == "v2" and not new.shard_done.any()
    assert new.rows([0], allow_missing=True).shape == (1, 24)


def test_missing_bucket_is_one_clear_line(s3_storage_options):
    with pytest.raises(StoreError) as info:
        create_store("s3://no-such-bucket/x.zarr", spec(), storage_options=s3_storage_options)
    assert "no-such-bucket" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        open_store("s3://no-such-bucket/x.zarr", storage_options=s3_storage_options)


def test_unreachable_endpoint_is_one_clear_line():
    # A closed port; one attempt and a short timeout keep the test fast.
    options = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}},
    }
    for call in (
        lambda: create_store("s3://b/x.zarr", spec(), storage_options=options),
        lambda: open_store("s3://b/x.zarr", storage_options=options),
    ):
        with pytest.raises(StoreError) as info:
            call()
        message = str(info.value)
        assert "s3://b/x.zarr" in message and "Could not connect" in message
        assert "\n" not in message
