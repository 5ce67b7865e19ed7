"""Tests of the store (src/classgrad/store/) on real files (tmp_path) and memory:// stores: round trips for
every dtype x codec, alignment, concurrent writers, external readers, corruption,
fingerprints, completeness, leases, run history and spec validation."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import zarr

from classgrad.errors import (
    CorruptChunkError,
    LeaseHeldError,
    StoreError,
    StoreIncompleteError,
    StoreMismatchError,
)
from classgrad.store import FORMAT_VERSION, ParamSlot, StoreSpec, create_store, open_dataset, open_store

DTYPES = ["float32", "float16", "bfloat16"]
CODECS = ["none", "zstd", "blosc"]
# Half a unit in the last place at the top of a row, relative to the row's max |value|:
# float16 keeps 10 explicit mantissa bits (spacing 2**-10 just below a power of two, so
# round-to-nearest errs by at most 2**-11 of the row max); bfloat16 keeps 7 (2**-8).
REL_TOL = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def make_spec(**kw) -> StoreSpec:
    base = dict(
        num_classes=50,
        dim=30,
        shard_rows=16,
        row_chunk=8,
        col_chunk=7,
        layout=(ParamSlot("w", (5, 4), 0, 20), ParamSlot("b", (10,), 20, 10)),
        fingerprint="fp-1",
        loss_kind="cross_entropy",
        config={"loss": {"kind": "cross_entropy"}},
    )
    base.update(kw)
    return StoreSpec(**base)


def make_rows(num_classes: int, dim: int, seed: int = 0) -> np.ndarray:
    """Rows spanning many magnitudes: tiny rows (all |g| < 1e-6), a zero row, large rows."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((num_classes, dim)).astype(np.float32)
    rows *= np.logspace(-12, 4, num_classes, dtype=np.float32)[:, None]
    rows[3] = 0.0
    assert (np.abs(rows[:10]) < 1e-6).all()  # the premise of the "tiny rows" case
    return rows


def fill(store, rows: np.ndarray, shards=None) -> None:
    for shard in range(store.num_shards) if shards is None else shards:
        start, stop = store.shard_range(shard)
        n = stop - start
        store.write_rows(start, rows[start:stop], loss=np.arange(start, stop) * 0.5, count=np.arange(start, stop) + 1)
        store.mark_shard_done(shard)
        assert n > 0


def stored_times_scale(path, dtype: str, grads: np.ndarray) -> np.ndarray:
    """What an outside reader computes from the raw arrays: stored values * row_scale."""
    scale = zarr.open_group(str(path), mode="r")["row_scale"][:]
    if dtype == "bfloat16":
        grads = (grads.astype(np.uint32) << 16).view(np.float32)
    return grads.astype(np.float32) * scale[:, None]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(tmp_path, dtype, codec, sharded):
    spec = make_spec(dtype=dtype, codec=codec, sharded=sharded)
    rows = make_rows(spec.num_classes, spec.dim)
    fill(create_store(str(tmp_path / "s"), spec), rows)

    store = open_store(str(tmp_path / "s"))
    out = store.rows(np.arange(store.num_classes))
    assert out.dtype == np.float32 and out.shape == rows.shape
    if dtype == "float32":
        assert np.array_equal(out.view(np.uint32), rows.view(np.uint32))  # bit-exact
    else:
        rowmax = np.abs(rows).max(axis=1)
        err = np.abs(out - rows).max(axis=1)
        assert (err <= REL_TOL[dtype] * rowmax).all()  # see REL_TOL for the size
        assert (out[3] == 0).all()
        if dtype == "float16":
            # Without row scaling the tiny rows would flush to zero or lose most bits in
            # float16's subnormal range: the same bound fails for them.
            naive = rows[:10].astype(np.float16).astype(np.float32)
            assert (np.abs(naive - rows[:10]).max(axis=1) > REL_TOL[dtype] * rowmax[:10]).any()
    scale = store.row_scale()
    assert np.array_equal(np.frexp(scale)[0], np.full_like(scale, 0.5))  # powers of two
    assert np.array_equal(store.loss(), (np.arange(50) * 0.5).astype(np.float32))
    assert np.array_equal(store.count(), np.arange(50) + 1)
    assert store.count().dtype == np.int64
    assert store.verify_chunks() == []


def test_bfloat16_rounds_to_nearest_even(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(1)
    rows = rng.standard_normal((16, 64)).astype(np.float32)
    # Exact ties (low 16 bits 0x8000) with both parities of the kept bit.
    rows[0, :4] = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF], dtype=np.uint32).view(np.float32)
    store = create_store(
        str(tmp_path / "s"), make_spec(num_classes=16, dim=64, layout=(), col_chunk=64, dtype="bfloat16")
    )
    fill(store, rows)
    bits = zarr.open_group(str(tmp_path / "s"), mode="r")["grads"][:]
    scale = store.row_scale()
    # Scales are powers of two, so dividing first does not change which way rounding goes.
    expected = (rows / scale[:, None]).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(bits, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_chunk_files_are_byte_identical_to_zarrs(tmp_path, dtype):
    """Local uncompressed stores write row chunks themselves; memory:// stores go through
    zarr-python's codec pipeline. Every chunk object, edge chunks included, must match."""
    import fsspec

    spec = make_spec(dtype=dtype)  # 50 x 30 in 8 x 7 chunks: short last row and column chunks
    rows = make_rows(spec.num_classes, spec.dim)
    fill(create_store(str(tmp_path / "s"), spec), rows)
    mem_url = f"memory://classgrad-tests/{uuid.uuid4().hex}"
    fill(create_store(mem_url, spec), rows)
    mem = fsspec.filesystem("memory")
    mem_root = mem_url[len("memory://") :]
    mem_chunks = {k.split(mem_root, 1)[1].lstrip("/") for k in mem.find(mem_root) if "/c/" in k}
    local_chunks = {
        os.path.relpath(os.path.join(r, f), tmp_path / "s")
        for r, _, fs in os.walk(tmp_path / "s")
        for f in fs
        if f != "zarr.json" and not r.endswith("shard_records")
    }
    # grads: 7 x 5 chunks; row_scale, loss, count: 7 each; shard_done: 4; the coordinates (format
    # 3): class_id and the four param arrays one each, param_id one per column chunk (5)
    assert local_chunks == mem_chunks and len(local_chunks) == 7 * 5 + 3 * 7 + 4 + 5 + 5
    for key in sorted(local_chunks):
        assert (tmp_path / "s" / key).read_bytes() == mem.cat_file(f"{mem_root}/{key}"), key


def test_memory_store_round_trip():
    url = f"memory://classgrad-tests/{uuid.uuid4().hex}"
    spec = make_spec(dtype="float16")
    rows = make_rows(spec.num_classes, spec.dim)
    fill(create_store(url, spec), rows)
    store = open_store(url)
    assert store.is_complete
    assert np.allclose(
        store.rows([5, 49]), rows[[5, 49]], rtol=0, atol=REL_TOL["float16"] * np.abs(rows[49]).max()
    )  # see REL_TOL


def test_ids_any_order_with_repeats_and_params(tmp_path):
    spec = make_spec()
    rows = make_rows(spec.num_classes, spec.dim)
    store = create_store(str(tmp_path / "s"), spec)
    fill(store, rows)
    ids = [49, 3, 3, 17, 0]
    assert np.array_equal(store.rows(ids), rows[ids])
    assert np.array_equal(store.rows(slice(10, 20)), rows[10:20])
    assert np.array_equal(store.param("w", ids), rows[ids, :20].reshape(5, 5, 4))
    assert np.array_equal(store.param("b", [7]), rows[[7], 20:30])
    assert store.rows([]).shape == (0, 30)
    with pytest.raises(StoreError, match="unknown parameter 'x'; the store holds: w, b"):
        store.param("x", [0])
    with pytest.raises(StoreError, match=r"row ids must lie in \[0, 50\)"):
        store.rows([50])


def test_metadata_round_trip(tmp_path):
    spec = make_spec(class_ids=tuple(range(100, 150)), class_names=tuple(f"c{i}" for i in range(50)))
    store = create_store(str(tmp_path / "s"), spec)
    again = open_store(str(tmp_path / "s"))
    assert again.spec.layout == spec.layout
    assert again.spec.class_ids == spec.class_ids and again.spec.class_names == spec.class_names
    assert np.array_equal(again.class_ids, np.arange(100, 150))
    assert again.class_names[:2] == ["c0", "c1"]
    assert (again.num_classes, again.dim, again.shard_rows, again.num_shards) == (50, 30, 16, 4)
    assert (again.row_chunk, again.col_chunk, again.dtype) == (8, 7, "float32")
    assert again.fingerprint == "fp-1" and store.shard_range(3) == (48, 50)
    attrs = again.attrs
    assert attrs["format_version"] == FORMAT_VERSION and attrs["checksum"] == "crc32c"
    assert attrs["layout"][0] == {"name": "w", "shape": [5, 4], "offset": 0, "size": 20}
    attrs["dim"] = -1  # a copy: the store is unaffected
    assert again.attrs["dim"] == 30
    # Plain zarr readers see the attributes too.
    assert zarr.open_group(str(tmp_path / "s"), mode="r").attrs["classgrad"]["loss_kind"] == "cross_entropy"


def test_bfloat16_attributes_say_how_it_is_stored(tmp_path):
    create_store(str(tmp_path / "s"), make_spec(dtype="bfloat16"))
    attrs = open_store(str(tmp_path / "s")).attrs
    assert attrs["storage_dtype"] == "uint16"
    assert "bfloat16 stored as uint16 bits, high half of float32" in attrs["encoding"]


# --------------------------------------------------------------------------- writing rules


def test_misaligned_writes_refused_and_last_short_chunk_works(tmp_path):
    store = create_store(str(tmp_path / "s"), make_spec())  # C=50, row_chunk=8
    rows = make_rows(50, 30)
    one = dict(loss=np.zeros(8), count=np.zeros(8))
    with pytest.raises(StoreError, match="misaligned write"):
        store.write_rows(4, rows[4:12], **one)  # start not on a chunk boundary
    with pytest.raises(StoreError, match="misaligned write"):
        store.write_rows(0, rows[0:5], loss=np.zeros(5), count=np.zeros(5))  # partial chunk
    with pytest.raises(StoreError, match="outside"):
        store.write_rows(48, rows[40:48], **one)  # runs past the last row
    # The last chunk holds rows 48..49 only: a short write that ends at C is whole.
    nbytes = store.write_rows(48, rows[48:50], loss=np.zeros(2), count=np.zeros(2))
    assert nbytes == 2 * 30 * 4 + 2 * (4 + 4 + 8)
    store.mark_shard_done(3)
    assert np.array_equal(store.rows([48, 49]), rows[48:50])


def test_sharded_store_writes_whole_shards(tmp_path):
    store = create_store(str(tmp_path / "s"), make_spec(sharded=True))
    assert store.write_align == 16
    rows = make_rows(50, 30)
    with pytest.raises(StoreError, match="multiple of 16"):
        store.write_rows(8, rows[8:16], loss=np.zeros(8), count=np.zeros(8))
    fill(store, rows)
    assert np.array_equal(store.rows(range(50)), rows)


def test_bad_rows_refused(tmp_path):
    store = create_store(str(tmp_path / "s"), make_spec())
    rows = make_rows(50, 30)[:8].copy()
    rows[2, 5] = np.inf
    with pytest.raises(StoreError, match=r"row 2 \(class 2\) has non-finite values"):
        store.write_rows(0, rows, loss=np.zeros(8), count=np.zeros(8))
    huge = np.full((16, 30), 3e38, dtype=np.float32)  # finite, though each row sums to inf
    store.write_rows(0, huge, loss=np.zeros(16), count=np.zeros(16))
    store.mark_shard_done(0)
    assert np.array_equal(store.rows(range(16)), huge)
    low = create_store(str(tmp_path / "f16"), make_spec(dtype="float16"))
    with pytest.raises(StoreError, match=r"row 2 \(class 2\) has non-finite values"):
        low.write_rows(0, rows, loss=np.zeros(8), count=np.zeros(8))
    with pytest.raises(StoreError, match=r"shape \[n, 30\]"):
        store.write_rows(0, rows[:, :10], loss=np.zeros(8), count=np.zeros(8))
    with pytest.raises(StoreError, match="loss and count"):
        store.write_rows(0, make_rows(50, 30)[:8], loss=np.zeros(7), count=np.zeros(8))


def test_read_only_store_refuses_writes(tmp_path):
    create_store(str(tmp_path / "s"), make_spec())
    store = open_store(str(tmp_path / "s"))
    with pytest.raises(StoreError, match="read-only"):
        store.write_rows(0, np.zeros((8, 30)), loss=np.zeros(8), count=np.zeros(8))
    with pytest.raises(StoreError, match="read-only"):
        store.mark_shard_done(0)


def _write_shards(url: str, shards: list[int], barrier) -> None:
    store = open_store(url, mode="r+")
    rows = make_rows(store.num_classes, store.dim, seed=7)
    barrier.wait()  # both processes write at the same time
    for shard in shards:
        start, stop = store.shard_range(shard)
        for a in range(start, stop, store.row_chunk):  # block by block, as workers do
            b = min(a + store.row_chunk, stop)
            store.write_rows(a, rows[a:b], loss=np.full(b - a, shard, dtype=np.float32), count=np.full(b - a, shard))
        store.mark_shard_done(shard)


def test_two_processes_write_different_shards_concurrently(tmp_path):
    url = str(tmp_path / "s")
    spec = make_spec(num_classes=200, dim=300, shard_rows=16, row_chunk=8, col_chunk=64, layout=())
    create_store(url, spec)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    # Interleaved shards, so the two writers touch neighbouring chunks and the same
    # directories all the time.
    procs = [ctx.Process(target=_write_shards, args=(url, list(range(k, spec.num_shards, 2)), barrier)) for k in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    store = open_store(url)
    assert store.is_complete
    assert np.array_equal(store.rows(range(200)), make_rows(200, 300, seed=7))
    assert np.array_equal(store.loss(), np.arange(200) // 16)
    assert store.verify_chunks() == []


# --------------------------------------------------------------------------- external readers


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_external_readers_agree(tmp_path, dtype, sharded):
    import dask.array as da
    import tensorstore as ts
    import xarray as xr

    path = tmp_path / "s"
    spec = make_spec(dtype=dtype, sharded=sharded, codec="zstd")
    fill(create_store(str(path), spec), make_rows(spec.num_classes, spec.dim))
    store = open_store(str(path))
    ours = store.rows(range(store.num_classes))

    raw_zarr = zarr.open_group(str(path), mode="r")["grads"][:]
    raw_dask = da.from_zarr(str(path), component="grads").compute()
    raw_ts = (
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "grads")}}, open=True)
        .result()
        .read()
        .result()
    )
    raw_xr = xr.open_zarr(str(path), mask_and_scale=False)["grads"].values  # consolidated (format 3)
    for raw in (raw_zarr, raw_dask, raw_ts, raw_xr):
        assert raw.dtype == raw_zarr.dtype
        # Decoding the raw values by the documented rule gives exactly our reader's values.
        assert np.array_equal(stored_times_scale(path, dtype, raw), ours)
    # The lazy views of true values.
    assert np.array_equal(store.to_dask().compute(), ours)
    arr = open_dataset(str(path))["grads"]
    assert arr.dtype == np.float32 and np.array_equal(arr.sel(class_id=[7, 9]).values, ours[[7, 9]])
    ds = xr.open_zarr(str(path))
    assert set(ds.data_vars) >= {"grads", "row_scale", "loss", "count", "shard_done"}
    assert ds["grads"].dims == ("class_id", "column")


# --------------------------------------------------------------------------- corruption


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("codec", CODECS)
def test_flipped_byte_is_reported_as_corruption(tmp_path, codec):
    path = tmp_path / "s"
    store = create_store(str(path), make_spec(codec=codec))
    rows = make_rows(50, 30)
    fill(store, rows)
    flip_byte(path / "grads" / "c" / "2" / "1")  # rows 16..23, columns 7..13
    reader = open_store(str(path))
    with pytest.raises(
        CorruptChunkError,
        match=r"grads chunk \(2, 1\) \(key grads/c/2/1, "
        r"rows \[16, 24\)\): crc32c checksum mismatch",
    ):
        reader.rows([17])
    with pytest.raises(CorruptChunkError, match="grads/c/2/1"):
        reader.param("w", [20])
    assert np.array_equal(reader.rows([15, 24]), rows[[15, 24]])  # other chunks still read
    problems = reader.verify_chunks()
    assert len(problems) == 1 and "grads/c/2/1" in problems[0]


def test_flipped_byte_in_sharded_store(tmp_path):
    path = tmp_path / "s"
    store = create_store(str(path), make_spec(sharded=True))
    fill(store, make_rows(50, 30))
    flip_byte(path / "grads" / "c" / "1" / "2")  # a zarr shard: rows 16..31, columns 14..20
    reader = open_store(str(path))
    with pytest.raises(CorruptChunkError, match="key grads/c/1/2"):
        reader.rows(range(16, 32))
    problems = reader.verify_chunks()
    assert problems and all("grads/c/1/2" in p for p in problems)


def test_corrupt_row_scale_and_missing_chunk(tmp_path):
    path = tmp_path / "s"
    store = create_store(str(path), make_spec(dtype="float16"))
    fill(store, make_rows(50, 30))
    flip_byte(path / "row_scale" / "c" / "0")
    (path / "grads" / "c" / "3" / "0").unlink()  # rows 24..31 of done shard 1
    reader = open_store(str(path))
    with pytest.raises(CorruptChunkError, match="row_scale chunk"):
        reader.rows([1])
    # The chunk is gone though its shard's record lists it: the read names it (before the
    # reader's own check of a done row read as never written would).
    with pytest.raises(CorruptChunkError, match=r"chunk grads/c/3/0 of shard 1 .* is missing, though its shard record"):
        reader.rows(range(24, 32))
    problems = reader.verify_chunks()
    assert any("row_scale/c/0" in p and "checksum" in p for p in problems)
    assert any("grads/c/3/0" in p and "missing" in p for p in problems)


# --------------------------------------------------------------------------- create / reopen


def test_fingerprint_rules(tmp_path, caplog):
    url = str(tmp_path / "s")
    store = create_store(url, make_spec())
    fill(store, make_rows(50, 30), shards=[0])

    again = create_store(url, make_spec())  # same fingerprint: resume, nothing rewritten
    assert again.shard_done.tolist() == [True, False, False, False]

    with pytest.raises(StoreMismatchError) as info:
        create_store(url, make_spec(fingerprint="fp-2"))
    message = str(info.value)
    assert "'fp-1'" in message and "'fp-2'" in message
    assert "--set store.overwrite=true" in message and "\n" not in message

    with pytest.raises(StoreMismatchError, match="different dtype"):
        create_store(url, make_spec(dtype="float16"))

    with caplog.at_level(logging.WARNING, logger="classgrad.store"):
        new = create_store(url, make_spec(fingerprint="fp-2"), overwrite=True)
    assert "overwrite" in caplog.text
    assert new.fingerprint == "fp-2" and not new.shard_done.any()


def test_refuses_locations_that_are_not_classgrad_stores(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(StoreError, match="not a classgrad store"):
            create_store(str(tmp_path / "data"), make_spec(), overwrite=overwrite)
    assert (tmp_path / "data" / "precious.txt").exists()

    zarr.open_group(str(tmp_path / "plain"), mode="w")
    with pytest.raises(StoreError, match="Zarr group but not a classgrad store"):
        open_store(str(tmp_path / "plain"))
    with pytest.raises(StoreError, match="no classgrad store at .*nowhere"):
        open_store(str(tmp_path / "nowhere"))
    with pytest.raises(StoreError, match="mode must be"):
        open_store(str(tmp_path / "plain"), mode="w")


def test_half_created_store_is_recreated_not_trusted(tmp_path):
    url = str(tmp_path / "s")
    create_store(url, make_spec())
    # Simulate a creation that was interrupted before it finished.
    group = zarr.open_group(url, mode="r+")
    meta = dict(group.attrs["classgrad"], state="creating")
    group.update_attributes({"classgrad": meta})
    with pytest.raises(StoreError, match="not fully created"):
        open_store(url)
    assert create_store(url, make_spec()).num_classes == 50
    open_store(url)


def test_unwritable_location_is_one_clear_line(tmp_path):
    (tmp_path / "file").write_text("x")
    url = str(tmp_path / "file" / "store")
    with pytest.raises(StoreError) as info:
        create_store(url, make_spec())
    # The lease, next to the store, is the first thing read there.
    assert re.match(rf"cannot (create store at|read store location) {re.escape(url)}: ", str(info.value))
    assert "\n" not in str(info.value)


def test_file_url(tmp_path):
    url = f"file://{tmp_path / 's'}"
    fill(create_store(url, make_spec()), make_rows(50, 30))
    assert open_store(str(tmp_path / "s")).is_complete


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(shard_rows=12), "shard_rows"),
        (dict(num_classes=0), "num_classes"),
        (dict(dtype="int8"), "dtype"),
        (dict(codec="lz4"), "codec"),
        (dict(layout=(ParamSlot("w", (5, 4), 0, 20),)), "layout"),
        (dict(layout=(ParamSlot("w", (5, 4), 0, 21), ParamSlot("b", (9,), 21, 9))), "layout"),
        (dict(class_ids=(1, 2)), "class_ids"),
        (dict(class_names=("a",)), "class_names"),
        (dict(projection={"kind": "rademacher", "dim": 30}), "layout"),
        (dict(config={"x": object()}), "config"),
    ],
)
def test_spec_validation_names_the_field(bad, field):
    with pytest.raises(StoreError, match=f"store spec: {field} "):
        make_spec(**bad)


def test_projected_store_and_col_chunk_clipping(tmp_path):
    spec = make_spec(layout=(), projection={"kind": "rademacher", "dim": 30, "seed": 0}, col_chunk=1 << 20)
    assert spec.col_chunk == 30
    store = create_store(str(tmp_path / "s"), spec)
    assert store.attrs["projection"]["kind"] == "rademacher"
    with pytest.raises(StoreError, match="projected"):
        store.param("w", [0])


# --------------------------------------------------------------------------- completeness


def test_missing_rows_refused_unless_allowed(tmp_path):
    store = create_store(str(tmp_path / "s"), make_spec())  # shards [0,16) [16,32) [32,48) [48,50)
    rows = make_rows(50, 30)
    fill(store, rows, shards=[1])
    assert not store.is_complete
    assert store.missing_ranges() == [(0, 16), (32, 50)]
    assert store.shard_done.tolist() == [False, True, False, False]
    with pytest.raises(StoreIncompleteError, match=r"rows \[0, 2\), \[40, 41\) .*allow_missing"):
        store.rows([0, 1, 20, 40])
    out = store.rows([0, 20, 40], allow_missing=True)
    assert np.isnan(out[[0, 2]]).all() and np.array_equal(out[1], rows[20])
    assert np.isnan(store.loss([0])).all() and store.count([0]).tolist() == [-1]
    with pytest.raises(StoreIncompleteError, match=r"\[0, 16\), \[32, 50\)"):
        next(store.iter_blocks(16))
    blocks = list(store.iter_blocks(20, allow_missing=True))  # rounded down to row_chunk
    assert [b[0] for b in blocks] == [0, 16, 32, 48]
    assert np.array_equal(blocks[1][1], rows[16:32])
    dask_view = store.to_dask().compute()
    assert np.isnan(dask_view[:16]).all() and np.array_equal(dask_view[16:32], rows[16:32])

    fill(store, rows, shards=[0, 2, 3])
    assert store.is_complete and store.missing_ranges() == []
    assert np.array_equal(np.concatenate([b for _, b in store.iter_blocks(24)]), rows)
    store.clear_shard_done(2)
    assert store.missing_ranges() == [(32, 48)]


# --------------------------------------------------------------------------- driver things


def test_lease(tmp_path, caplog):
    url = str(tmp_path / "s")
    store = create_store(url, make_spec())
    store.lease.acquire("run-a", info={"config": "demo.yaml"})
    store.lease.acquire("run-a")  # the holder may re-acquire
    store.lease.renew("run-a")
    with pytest.raises(LeaseHeldError, match="in use by run 'run-a'"):
        create_store(url, make_spec(fingerprint="fp-2"), overwrite=True)
    other = open_store(url, mode="r+")
    with pytest.raises(LeaseHeldError) as info:
        other.lease.acquire("run-b", ttl_s=60)
    message = str(info.value)
    assert "'run-a'" in message and f"pid {os.getpid()}" in message and "host" in message

    # A lease whose heartbeat is older than its holder's TTL is stale: taken over, with a warning.
    store.lease.acquire("run-a", ttl_s=0.0)  # the holder renews with a TTL of 0: stale at once
    with caplog.at_level(logging.WARNING, logger="classgrad.store"):
        other.lease.acquire("run-b", ttl_s=60.0)
    assert "stale lease of run 'run-a'" in caplog.text
    with pytest.raises(LeaseHeldError, match="lost its lease .* run 'run-b'"):
        store.lease.renew("run-a")
    store.lease.release("run-a")  # not the holder: left alone
    with pytest.raises(LeaseHeldError):
        store.lease.acquire("run-a")
    other.lease.release("run-b")
    assert not (tmp_path / "s.classgrad-lease.json").exists()
    store.lease.acquire("run-a")
    with pytest.raises(StoreError, match="read-only"):
        open_store(url).lease.acquire("run-c")


def test_lease_of_a_dead_driver_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    url = str(tmp_path / "s")
    create_store(url, make_spec())
    # A real process that has exited: its pid is provably gone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    lease = {
        "run_id": "run-dead",
        "host": socket.gethostname(),
        "pid": dead_pid,
        "started": time.time(),
        "heartbeat": time.time(),
        "ttl_s": 60.0,
        "info": {},
    }
    (tmp_path / "s.classgrad-lease.json").write_text(json.dumps(lease))
    store = open_store(url, mode="r+")
    assert store.lease.info()["run_id"] == "run-dead"
    with caplog.at_level(logging.WARNING, logger="classgrad.store"):
        store.lease.acquire("run-new", ttl_s=60.0)  # fresh heartbeat, but the holder is gone
    assert "its driver process is gone" in caplog.text
    assert store.lease.info()["run_id"] == "run-new"
    # The same lease held by a live process (this one) is respected.
    lease.update(run_id="run-live", pid=os.getpid())
    (tmp_path / "s.classgrad-lease.json").write_text(json.dumps(lease))
    with pytest.raises(LeaseHeldError, match="run-live"):
        store.lease.acquire("run-new2", ttl_s=60.0)


def test_append_run(tmp_path):
    url = str(tmp_path / "s")
    store = create_store(url, make_spec())
    store.append_run({"start": 1.0, "end": 2.0, "rows": 50, "seconds": 1.0, "retries": 0})
    store.append_run({"start": 3.0, "note": object()})  # non-JSON values become strings
    runs = open_store(url).runs
    assert runs[0]["rows"] == 50 and isinstance(runs[1]["note"], str)
    assert store.runs == runs
    # Reopening for resume keeps the history.
    assert len(create_store(url, make_spec()).runs) == 2


def test_metadata_is_plain_json_without_storage_options(tmp_path):
    url = str(tmp_path / "s")
    create_store(url, make_spec(), storage_options={"secret": "hunter2", "key": "AKIA-SECRET"})
    for root, _, files in os.walk(url):
        for name in files:
            if name == "zarr.json":
                text = open(os.path.join(root, name)).read()
                json.loads(text)
                assert "hunter2" not in text and "AKIA-SECRET" not in text
