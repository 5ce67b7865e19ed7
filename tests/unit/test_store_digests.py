"""Digests checked on read (``classgrad.store.integrity.verified``, issue 45, item 2): a valid chunk
copied over another of a done shard (its crc32c is valid) is refused by every reader in one line
naming the chunk and its shard, plain and Zarr-sharded; rows of other shards still read; a saved
TRAK preconditioner is not reused over it (item 3); ``verify --repair`` unmarks the shard and drops
its record, and a rerun recomputes the same rows; ``status`` says it read the done marks only.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from classgrad.errors import CorruptChunkError, StoreIncompleteError
from classgrad.service.analysis.score_driver import score_rows
from classgrad.service.analysis.verify import CORRUPT, verify_store
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.jobs import mlp_job, run_without_ray
from tests.support.stores import synthetic_store


@pytest.fixture(params=[False, True], ids=["chunks", "zarr-shards"])
def copied(request, tmp_path):
    """A store of 200 rows (work shards of 64, chunks of 16 rows) whose object holding rows 80-95
    (with Zarr sharding: the Zarr shard holding rows 64-127, one object a work shard, read in
    parts) is a copy of the previous one."""
    path = tmp_path / "s"
    _, rows = synthetic_store(path, num_classes=200, sharded=request.param)
    src, dst = ("grads/c/0/0", "grads/c/1/0") if request.param else ("grads/c/4/0", "grads/c/5/0")
    assert (path / src).stat().st_size == (path / dst).stat().st_size  # a valid object of the same size
    shutil.copyfile(path / src, path / dst)
    return path, rows, dst


def test_every_reader_refuses_a_copied_chunk_in_one_line(copied, capsys):
    path, rows, key = copied
    store = open_store(str(path))
    readers = [
        lambda: store.rows(np.arange(200)),
        lambda: list(store.iter_blocks(50)),
        lambda: store.to_dask().compute(),
        lambda: store.to_xarray()["grads"].values,
    ]
    for read in readers:
        with pytest.raises(CorruptChunkError, match=f"chunk {key} of shard 1") as info:
            read()
        assert "\n" not in str(info.value) and "verify --repair" in str(info.value)
    np.testing.assert_array_equal(store.rows(np.arange(64)), rows[:64])  # shard 0: as written
    np.testing.assert_array_equal(store.rows(np.arange(128, 200)), rows[128:])
    for command in (["inspect", str(path)], ["similarity", str(path), "--local"]):
        assert cli_main(command) != 0
        err = capsys.readouterr().err.strip().splitlines()
        # One line: the failure is raised after Zarr's fetches are over, none left pending.
        assert len(err) == 1 and f"chunk {key} of shard 1" in err[0], err


def test_a_copied_chunk_whose_shard_record_is_deleted_is_refused_by_every_reader(copied):
    """Before: ``rows()`` refused, but ``to_dask`` and ``open_dataset(...)["grads"].values``
    returned row 64's data as row 80 (issue 60, item 5)."""
    from classgrad.store import open_dataset

    path, rows, _ = copied
    (path / "shard_records" / "1.json").unlink()
    store = open_store(str(path))
    readers = [
        lambda: store.rows(np.arange(80, 96)),
        lambda: store.to_dask()[80:96].compute(),
        lambda: store.to_xarray()["grads"].values,
        lambda: open_dataset(str(path))["grads"][64:128].values,
        lambda: open_dataset(str(path))["loss"].values,
    ]
    for read in readers:
        with pytest.raises(
            CorruptChunkError, match=r"shard 1 \(rows from 64\) is marked done but its record is missing"
        ):
            read()
    np.testing.assert_array_equal(open_dataset(str(path))["grads"][:64].values, rows[:64])  # shard 0 reads


def test_a_saved_preconditioner_is_not_reused_over_a_changed_chunk(tmp_path):
    path = tmp_path / "s"
    store, rows = synthetic_store(path, num_classes=200, projected=True)
    queries = np.random.default_rng(0).standard_normal((3, store.dim)).astype(np.float32)
    first = score_rows([store], [queries], method="trak", executor="local")
    assert store.preconditioner.info() is not None  # saved beside the rows
    shutil.copyfile(path / "grads/c/4/0", path / "grads/c/5/0")
    with pytest.raises(CorruptChunkError, match="chunk grads/c/5/0 of shard 1"):
        score_rows([open_store(str(path), mode="r+")], [queries], method="trak", executor="local")
    assert first.scores.shape == (3, 10)


def test_verify_repair_and_a_rerun_recompute_the_shard(tmp_path, capsys):
    config = mlp_job(tmp_path)
    store = run_without_ray(config)
    want = store.rows(np.arange(store.num_classes))
    url = config.store.url
    shutil.copyfile(f"{url}/grads/c/2/0", f"{url}/grads/c/3/0")  # rows 12-15 of shard 1 (shards of 8 rows)
    assert cli_main(["status", url]) == 0
    out = capsys.readouterr().out
    assert "3/3 shards" in out and "complete" in out and "done marks only" in out
    report = verify_store(url, repair=True)
    assert report.code & CORRUPT and report.repaired == [1]
    assert open_store(url).shard_record(1) is None  # a record exists only for a shard marked done
    with pytest.raises(StoreIncompleteError):
        open_store(url).rows(np.arange(16))
    again = run_without_ray(config)
    # The same shard recomputed by the same worker code: the same float32 sums.
    np.testing.assert_array_equal(again.rows(np.arange(again.num_classes)), want)
    assert verify_store(url).code == 0


def test_a_record_of_another_creation_of_the_store_vouches_for_nothing(tmp_path):
    """What a run that lost the store leaves (issue 45, item 1): its shard records carry the
    generation of the store it opened. Readers refuse such a shard, verify flags it, and a rerun
    recomputes it; without Ray, the record is rewritten as that run would have."""
    config = mlp_job(tmp_path)
    store = run_without_ray(config)
    want = store.rows(np.arange(store.num_classes))
    assert store.generation and store.shard_record(1).generation == store.generation
    stale = store.shard_record(1)
    stale.generation = "an-earlier-creation"
    (tmp_path / "s.zarr" / "shard_records" / "1.json").write_bytes(stale.to_bytes())
    with pytest.raises(CorruptChunkError, match="shard 1 .*a run that no longer owned the store"):
        open_store(config.store.url).rows(np.arange(8, 16))
    report = verify_store(config.store.url)
    assert report.code & CORRUPT and any("no longer owned" in p for p in report.problems["corrupt"])
    again = run_without_ray(config)  # the resume's listing check unmarks it; the worker recomputes it
    np.testing.assert_array_equal(again.rows(np.arange(again.num_classes)), want)
    assert verify_store(config.store.url).code == 0


def test_a_run_record_is_not_appended_to_a_store_created_again_since(tmp_path):
    from classgrad.errors import StoreError
    from classgrad.store import create_store

    first, _ = synthetic_store(tmp_path / "s", num_classes=64)
    again = create_store(str(tmp_path / "s"), first.spec, overwrite=True, recompute=True)
    assert again.generation != first.generation
    with pytest.raises(StoreError, match="created again by another run since this one opened it"):
        first.append_run({"run_id": "lost"})
    assert open_store(str(tmp_path / "s")).runs == []
