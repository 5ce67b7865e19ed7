"""Store formats through real jobs on a local Ray: a finished format-3 store opens with plain
``xr.open_zarr(url)`` (consolidated by the driver; the actors wrote only rows), and a format-2
store (fixture) resumes at version 2; on object storage (moto), the consolidated metadata is
written and kept current as on a disk."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import classgrad
from classgrad.config import load_config
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.analysis.verify import verify_store
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import StoreSpec, create_store, open_store
from tests.support.stores import DIM, LAYOUT, synthetic_rows, write_all
from tests.support.xarray_checks import assert_consolidated_fresh, open_zarr_strict

pytestmark = pytest.mark.usefixtures("ray_local")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"


def test_a_finished_bfloat16_job_opens_with_plain_xarray(job_config):
    config = job_config(store={"dtype": "bfloat16", "col_chunk": 64})
    summary = JobDriver(config).run()
    assert summary.status == "complete"
    url = config.store.url
    store = open_store(url)
    rows = store.rows(np.arange(store.num_classes))
    assert_consolidated_fresh(url)
    ds = open_zarr_strict(url)  # no arguments, no warning
    assert store.runs[-1]["status"] == "complete"
    assert ds["grads"].dtype == np.uint16 and ds.sizes["class_id"] == 48
    slot = store.layout[-1]
    p = ds.sel(param=slot.name)
    assert (int(p["param_offset"]), int(p["param_size"])) == (slot.offset, slot.size)
    true = classgrad.open_dataset(url)["grads"]  # the documented route to true values
    assert true.dtype == np.float32
    np.testing.assert_array_equal(true.values, rows)
    picked = true.sel(class_id=[5, 6]).isel(column=slice(slot.offset, slot.offset + slot.size)).values
    np.testing.assert_array_equal(picked.reshape(2, *slot.shape), store.param(slot.name, [5, 6]))


def test_a_format_2_store_resumes_through_a_job_at_version_2(tmp_path):
    copy = tmp_path / "v2_bf16.zarr"
    shutil.copytree(FIXTURES / "v2_bf16.zarr", copy)
    expected = open_store(str(copy)).rows(np.arange(12))
    zarr.open_array(str(copy / "shard_done"), mode="r+")[1] = 0  # shard 1 (rows 4-7) to redo
    zarr.open_array(str(copy / "grads"), mode="r+")[4:8] = 0x7FC0  # its rows wiped (the NaN bits)
    config = load_config(FIXTURES / "v2_bf16.yaml", [f"store.url={copy}", "run.progress=log"])
    summary = JobDriver(config).run()
    assert summary.status == "complete" and (summary.shards_done, summary.shards_skipped) == (1, 2)
    store = open_store(str(copy))
    assert store.format_version == 2 and store.is_complete
    root = json.loads((copy / "zarr.json").read_text())
    assert "consolidated_metadata" not in root and not (copy / "class_id").exists()
    # Same model, data and CPU arithmetic as the run that wrote the fixture, rounded to
    # bfloat16: the rows come back bit for bit unless a later torch orders float32 sums
    # differently, which can move a value by one bfloat16 step (at most 2**-7 relative).
    np.testing.assert_allclose(store.rows(np.arange(12)), expected, rtol=2**-7, atol=0)


def test_consolidated_metadata_on_object_storage(s3_bucket, s3_storage_options):
    url = f"s3://{s3_bucket}/store"
    names = tuple(f"c{i}" for i in range(96))
    spec = StoreSpec(
        num_classes=96,
        dim=DIM,
        shard_rows=32,
        row_chunk=16,
        col_chunk=40,
        dtype="float16",
        layout=LAYOUT,
        class_names=names,
        fingerprint="s3",
    )
    store = create_store(url, spec, storage_options=s3_storage_options)
    write_all(store, synthetic_rows(96, DIM))
    true = store.rows(np.arange(96))
    compute_similarity(url, storage_options=s3_storage_options, executor="local", top_k=3, block_rows=32)
    assert verify_store(url, storage_options=s3_storage_options).code == 0  # consolidated and current
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = xr.open_zarr(url, storage_options=s3_storage_options)
    assert ds["similarity_topk_index"].shape == (96, 3) and ds.sel(class_id=4)["class_name"].values.item() == "c4"
    opened = classgrad.open_dataset(url, storage_options=s3_storage_options)
    np.testing.assert_array_equal(opened["grads"].values, true)
