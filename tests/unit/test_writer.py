"""The row writer (``classgrad.workers.actor_runtime.shard_writer``): blocks of any size go into the store in
whole-chunk runs, in order, off the compute thread; too many or too few rows and failed writes
are errors; marking the shard done is left to its caller."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classgrad.errors import StoreError
from classgrad.store import StoreSpec, create_store
from classgrad.workers.actor_runtime.shard_writer import ShardWriter
from classgrad.workers.engines import RowBlock

DIM = 3


def make_store(tmp_path):
    """10 rows in chunks of 4, shards of 8: shard 0 is rows [0, 8), shard 1 rows [8, 10)."""
    return create_store(str(tmp_path / "s.zarr"), StoreSpec(num_classes=10, dim=DIM, shard_rows=8, row_chunk=4))


def block(start: int, n: int) -> RowBlock:
    """Rows whose every value is their row index + 1; loss 0.5 * (row + 1), count row + 2."""
    ids = torch.arange(start, start + n)
    return RowBlock(
        classes=ids,
        rows=(ids + 1).float()[:, None].expand(n, DIM).clone(),
        loss=0.5 * (ids + 1).float(),
        count=ids + 2,
        loss_scale=torch.ones(n),
        recomputed=torch.zeros(n, dtype=torch.bool),
    )


def recording(store) -> list[tuple[int, int]]:
    """Record (start, rows) of each write the store gets."""
    calls: list[tuple[int, int]] = []
    write = store.write_rows

    def spy(start, rows, **kwargs):
        calls.append((start, len(rows)))
        return write(start, rows, **kwargs)

    store.write_rows = spy
    return calls


def test_blocks_of_any_size_are_written_in_whole_chunks(tmp_path):
    store = make_store(tmp_path)
    calls = recording(store)
    writer = ShardWriter(store, 0, 8)
    writer.add(block(0, 3))
    assert writer.next_row == 0  # 3 rows: less than a chunk, held back
    writer.add(block(3, 2))
    assert writer.next_row == 4  # one whole chunk handed over, one row held back
    writer.add(block(5, 3))
    stats = writer.close()
    assert calls == [(0, 4), (4, 4)]
    assert stats.rows == 8 and stats.bytes > 0
    assert not store.shard_done[0]  # the caller marks the shard done, once it trusts the rows
    store.mark_shard_done(0)
    # Stored float32 values read back as written: exact.
    assert np.array_equal(store.rows(np.arange(8)), np.repeat(np.arange(1.0, 9.0)[:, None], DIM, axis=1))
    assert np.array_equal(store.loss(np.arange(8)), 0.5 * np.arange(1.0, 9.0))
    assert np.array_equal(store.count(np.arange(8)), np.arange(2, 10))


def test_the_short_last_shard_is_written_whole_and_rows_may_replace_the_blocks(tmp_path):
    store = make_store(tmp_path)
    calls = recording(store)
    writer = ShardWriter(store, 8, 10)
    writer.add(block(8, 2), rows=torch.full((2, DIM), 7.0, dtype=torch.float64))  # e.g. projected rows
    writer.close()
    assert calls == [(8, 2)]  # 2 rows, less than a chunk, but the end of the store
    store.mark_shard_done(1)
    assert np.array_equal(store.rows([8, 9]), np.full((2, DIM), 7.0, dtype=np.float32))


def test_more_or_fewer_rows_than_the_range_are_errors(tmp_path):
    store = make_store(tmp_path)
    writer = ShardWriter(store, 8, 10)
    with pytest.raises(StoreError, match=r"more rows than its range \[8, 10\) holds"):
        writer.add(block(8, 3))
    writer.abort()
    short = ShardWriter(store, 0, 8)
    short.add(block(0, 5))
    with pytest.raises(StoreError, match=r"closed with rows \[4, 8\) not written"):
        short.close()


def test_a_failed_write_surfaces_on_the_callers_thread(tmp_path):
    store = make_store(tmp_path)

    def broken(start, rows, **kwargs):
        raise StoreError("disk full")

    store.write_rows = broken
    writer = ShardWriter(store, 0, 8)
    writer.add(block(0, 4))  # handed to the writer thread, which fails
    with pytest.raises(StoreError, match="disk full"):
        writer.close()


def test_abort_stops_the_thread_without_raising(tmp_path):
    writer = ShardWriter(make_store(tmp_path), 0, 8)
    writer.add(block(0, 2))
    writer.abort()
    assert not writer._thread.is_alive()
    with pytest.raises(StoreError, match="writer aborted"):
        writer.add(block(2, 2))
