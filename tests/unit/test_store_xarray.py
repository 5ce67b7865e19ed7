"""Format 3 read the way xarray and dask users work: ``xr.open_zarr(url)`` with no arguments and
no warning, selection by class id and by parameter name, ``classgrad.open_dataset`` giving
float32 true values whatever the stored dtype, consolidated metadata that stays true (after a
run, ``classgrad similarity`` and a repair; never touched by row writers), and the stores of
formats 1 and 2 (fixtures) still read, and resumed at their own version."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import classgrad
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.analysis.verify import METADATA, verify_store
from classgrad.store import StoreSpec, create_store, open_store
from classgrad.store.core.coords import consolidated_root
from classgrad.store.core.format import spec_from_meta
from classgrad.store.core.location import Location
from classgrad.store.store_keys import is_store_key, list_keys
from tests.support.stores import model_store, synthetic_store
from tests.support.xarray_checks import assert_consolidated_fresh, open_zarr_strict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"


def test_open_zarr_on_a_finished_store_selects_by_class_id_and_parameter_name(tmp_path):
    store, _, rows = model_store(tmp_path / "m", num_classes=200)  # real per-class gradients of an MLP
    store.append_run({"status": "complete"})  # what the driver does at the end of a run
    ds = open_zarr_strict(tmp_path / "m")  # no consolidated=False, no warning
    assert ds["grads"].dims == ("class_id", "column") and ds["loss"].dims == ("class_id",)
    assert ds["grads"].attrs["long_name"] and "float32" in ds["grads"].attrs["true_values"]
    # float32 store: the stored values are the true values.
    np.testing.assert_array_equal(ds["grads"].sel(class_id=[5, 17]).values, rows[[5, 17]])
    assert ds.sel(class_id=5)["count"].values == store.count([5])[0]
    for i, slot in enumerate(store.layout):
        p = ds.sel(param=slot.name)  # one parameter: its offset, size and shape
        offset, size = int(p["param_offset"]), int(p["param_size"])
        assert (offset, size, json.loads(p["param_shape"].values.item())) == (slot.offset, slot.size, list(slot.shape))
        cols = ds["grads"].isel(column=slice(offset, offset + size)).sel(class_id=[0, 9]).values
        np.testing.assert_array_equal(cols.reshape(2, *slot.shape), store.param(slot.name, [0, 9]))
        # the per-column parameter id: the same columns, without a D-long string coordinate
        mask = (ds["param_id"] == i).values
        np.testing.assert_array_equal(ds["grads"].isel(column=mask).sel(class_id=[0, 9]).values, cols)
    assert ds["param_id"].dtype == np.int16 and ds["param_id"].chunks == ds["grads"].chunks[1:]
    assert_consolidated_fresh(tmp_path / "m")


def test_open_dataset_selects_a_parameters_columns_by_name_with_its_shape_in_integers(tmp_path):
    store, _, rows = model_store(tmp_path / "m", num_classes=50)
    ds = classgrad.open_dataset(str(tmp_path / "m"))
    for slot in store.layout:
        cols = ds["grads"].sel(param=slot.name)  # lazily: the parameter's columns, a slice
        shape = ds["param_shape"].sel(parameter=slot.name).item()
        assert shape == tuple(slot.shape) and all(type(n) is int for n in shape)
        assert cols.dims == ("class_id", "column") and cols.chunks is not None
        np.testing.assert_array_equal(cols.values.reshape(50, *shape), store.param(slot.name, np.arange(50)))
        want = rows[[3, 4], slot.offset : slot.offset + slot.size]
        np.testing.assert_array_equal(cols.sel(class_id=[3, 4]).values, want)
        offset = int(ds["param_offset"].sel(parameter=slot.name))
        assert (offset, int(ds["param_size"].sel(parameter=slot.name))) == (slot.offset, slot.size)
    assert ds["param"].dims == ("column",) and "param" in ds["grads"].coords  # what sel(param=...) reads
    assert list(ds["parameter"].values) == [slot.name for slot in store.layout]
    with pytest.raises(KeyError):
        ds["grads"].sel(param="no.such.parameter")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_open_dataset_gives_float32_true_values_equal_to_the_reader(tmp_path, dtype):
    store, _, rows = model_store(tmp_path / "m", num_classes=100, dtype=dtype)
    raw = open_zarr_strict(tmp_path / "m")["grads"]
    assert raw.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)
    assert "classgrad.open_dataset" in raw.attrs["true_values"]  # the stored bits say how to decode them
    ds = classgrad.open_dataset(str(tmp_path / "m"))
    grads = ds["grads"]
    assert grads.dtype == np.float32 and grads.chunks is not None  # lazy, dask-backed
    np.testing.assert_array_equal(grads.values, open_store(str(tmp_path / "m")).rows(np.arange(100)))
    np.testing.assert_array_equal(grads.sel(class_id=[3, 4]).values, rows[[3, 4]])
    assert ds.attrs["stored_dtype"] == dtype and ds.attrs["format_version"] == 4


def test_class_names_ids_and_a_projected_store(tmp_path):
    names = tuple(f"class {i}" for i in range(64))
    store, true = synthetic_store(
        tmp_path / "p", num_classes=64, dim=48, projected=True, class_ids=tuple(range(100, 164)), class_names=names
    )
    ds = open_zarr_strict(tmp_path / "p")
    assert ds.sel(class_id=107)["class_name"].values.item() == "class 7"
    assert "param" not in ds.coords and "param_id" not in ds.coords  # no column -> parameter mapping
    assert "no column -> parameter mapping" in ds["grads"].attrs["columns"]
    opened = store.to_xarray()  # the same Dataset through the reader API
    assert list(opened["class_name"].values[:2]) == ["class 0", "class 1"]
    np.testing.assert_array_equal(opened["grads"].sel(class_id=[100, 163]).values, true[[0, 63]])


def test_row_writers_leave_the_metadata_alone_and_the_driver_rewrites_it(tmp_path):
    url = str(tmp_path / "s")
    driver, _ = synthetic_store(url, num_classes=128, shards=[])  # created, no row written yet
    before = (tmp_path / "s" / "zarr.json").read_bytes()
    worker = open_store(url, mode="r+")  # as an actor opens it
    rows = np.ones((64, 96), dtype=np.float32)
    worker.write_rows(0, rows, loss=np.ones(64), count=np.ones(64))
    worker.mark_shard_done(0)
    assert (tmp_path / "s" / "zarr.json").read_bytes() == before  # chunk data and records only
    driver.append_run({"status": "interrupted"})  # format 4: an object of its own, not zarr.json
    assert (tmp_path / "s" / "zarr.json").read_bytes() == before
    assert open_store(url).runs == [{"status": "interrupted"}]
    assert_consolidated_fresh(url)
    assert open_zarr_strict(url)["shard_done"].values.tolist() == [1, 0]


def test_consolidated_metadata_follows_similarity_and_a_repair(tmp_path):
    url = str(tmp_path / "s")
    synthetic_store(url, num_classes=128)
    compute_similarity(url, executor="local", top_k=4, block_rows=64)
    assert_consolidated_fresh(url)
    ds = open_zarr_strict(url)
    assert ds["similarity"].dims == ("class_id", "other_class_id")
    assert ds["similarity"].attrs["state"] == "ready" and ds["similarity_topk_index"].shape == (128, 4)
    compute_similarity(url, executor="local", top_k=0, block_rows=64)  # a rerun removes the top-k arrays
    assert_consolidated_fresh(url)
    ds = open_zarr_strict(url)
    assert "similarity_topk_index" not in ds and ds["similarity"].attrs["top_k"] == 0
    assert "other_class_id" in classgrad.open_dataset(url).coords  # finished: labelled both ways
    os.remove(tmp_path / "s" / "grads" / "c" / "5" / "1")  # a lost chunk in shard 1 (rows 64-127)
    report = verify_store(url, repair=True)
    assert report.repaired == [1]
    assert_consolidated_fresh(url)
    assert open_zarr_strict(url)["shard_done"].values.tolist() == [1, 0]


def test_our_consolidated_metadata_is_what_zarr_writes(tmp_path):
    """Written from the nodes a store has (zarr's own lists every shard record and warns about
    each); on a store without records both must agree to the byte of JSON content."""
    url = str(tmp_path / "s")
    synthetic_store(url, num_classes=100, shards=[], class_names=tuple(map(str, range(100))))
    ours = json.loads(consolidated_root(Location(url, None)))
    with warnings.catch_warnings():
        # zarr 3.1 warns that consolidated metadata is not in the Zarr v3 specification
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        zarr.consolidate_metadata(url)
    assert json.loads((tmp_path / "s" / "zarr.json").read_text()) == ours
    assert zarr.open_group(url, mode="r", use_consolidated=True)["class_name"][:2].tolist() == ["0", "1"]


def test_an_overwrite_deletes_every_key_of_a_format_3_store(tmp_path):
    url = str(tmp_path / "s")
    synthetic_store(url, num_classes=64, class_names=tuple(map(str, range(64))))
    spec = StoreSpec(num_classes=32, dim=8, shard_rows=16, row_chunk=8, fingerprint="another config")
    store = create_store(url, spec, overwrite=True)
    keys = list_keys(Location(url, None))
    assert keys.others == [] and not (tmp_path / "s" / "class_name").exists()
    assert store.num_classes == 32 and open_zarr_strict(url).sizes["class_id"] == 32
    # The temporary file of an interrupted rewrite of the group's metadata is the store's too.
    assert is_store_key(f"zarr.json.{'0' * 32}.partial") and is_store_key("param_id/c/3")
    assert not is_store_key("zarr.json.bak")


@pytest.mark.parametrize("name, version", [("v1_resume.zarr", 1), ("v2_bf16.zarr", 2)])
def test_older_formats_are_read_by_open_store_and_open_dataset(name, version):
    url = str(FIXTURES / name)
    store = open_store(url)
    assert store.format_version == version and store.is_complete
    rows = store.rows(np.arange(store.num_classes))
    ds = classgrad.open_dataset(url)  # format 3's names and coordinates, whatever the format
    assert ds["grads"].dims == ("class_id", "column") and ds["grads"].dtype == np.float32
    np.testing.assert_array_equal(ds["grads"].values, rows)
    first = store.layout[0]
    assert int(ds["param_size"].sel(parameter=first.name)) == first.size
    np.testing.assert_array_equal(ds["grads"].values[:, ds["param_id"].values == 0], rows[:, : first.size])
    np.testing.assert_array_equal(ds["grads"].sel(param=first.name).values, rows[:, : first.size])
    legacy = xr.open_zarr(url, consolidated=False)  # as written: no coordinates, old names
    assert legacy["grads"].dims == ("class", "param")


def test_a_format_2_store_resumes_at_version_2(tmp_path):
    url = str(tmp_path / "v2.zarr")
    shutil.copytree(FIXTURES / "v2_bf16.zarr", url)
    meta = open_store(url).attrs
    store = create_store(url, spec_from_meta(meta))  # the same config: reopened to resume
    assert store.format_version == 2
    start, stop = store.shard_range(1)
    rows = store.rows(np.arange(start, stop))
    store.clear_shard_done(1)
    store.write_rows(start, rows, loss=store.loss(np.arange(start, stop)), count=store.count(np.arange(start, stop)))
    store.mark_shard_done(1)
    store.append_run({"status": "complete"})
    store.consolidate()  # a format-2 store is left as it was written
    root = json.loads((Path(url) / "zarr.json").read_text())
    assert "consolidated_metadata" not in root and root["attributes"]["classgrad"]["format_version"] == 2
    assert not (Path(url) / "class_id").exists()
    compute_similarity(url, executor="local", top_k=2, block_rows=4)
    assert xr.open_zarr(url, consolidated=False)["similarity"].dims == ("class", "other_class")
    again = open_store(url)
    assert again.format_version == 2 and again.is_complete
    np.testing.assert_array_equal(again.rows(np.arange(start, stop)), rows)
    assert verify_store(url).code == 0


def test_verify_finds_stale_consolidated_metadata_and_wrong_coordinates_and_repair_rewrites_it(tmp_path):
    url = str(tmp_path / "s")
    synthetic_store(url, num_classes=128)
    assert verify_store(url).code == 0
    # Another tool rewrites the group's metadata without consolidating (zarr drops the copy).
    zarr.open_group(url, mode="r+", use_consolidated=False).update_attributes({"note": "edited"})
    report = verify_store(url)
    assert report.code == METADATA and "consolidated metadata is missing" in report.problems["metadata"][0]
    report = verify_store(url, repair=True)
    assert "repair: rewrote the consolidated metadata" in report.notes and report.repaired == []
    assert_consolidated_fresh(url)
    assert verify_store(url).code == 0 and open_zarr_strict(url).attrs["note"] == "edited"
    # A coordinate that disagrees with the metadata (the class of row 3 changed by hand).
    zarr.open_array(f"{url}/class_id", mode="r+")[3] = 99
    assert verify_store(url).problems["metadata"] == [
        "coordinate 'class_id' differs from the store's metadata (values or dimensions ['class_id'])"
    ]
