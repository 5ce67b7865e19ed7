"""``indexing.rows_by_chunks``: rows gathered from whole row chunks, each read once, in any order."""

from __future__ import annotations

import numpy as np
import pytest

from classgrad.store.core.indexing import rows_by_chunks

ROWS, CHUNK = 23, 5  # the last chunk short (3 rows)


def _read(calls: list[int]):
    data = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)

    def read(j: int, start: int, stop: int) -> np.ndarray:
        calls.append(j)
        assert (start, stop) == (j * CHUNK, min((j + 1) * CHUNK, ROWS))
        return data[start:stop].copy()  # a fresh block, as a checked read gives

    return data, read


@pytest.mark.parametrize(
    "ids",
    [
        np.arange(ROWS),  # the whole array: the chunks as read
        np.arange(5, 10),  # one whole chunk
        np.arange(20, 23),  # the short last chunk
        np.arange(3, 17),  # a run over parts of chunks
        np.array([7]),
        np.array([22, 0, 7, 7, 13]),  # any order, repeats
        np.array([4, 5]),  # consecutive across a chunk boundary
    ],
)
def test_rows_equal_direct_indexing_each_chunk_read_once(ids: np.ndarray) -> None:
    calls: list[int] = []
    data, read = _read(calls)
    got = rows_by_chunks(ids.astype(np.int64), CHUNK, ROWS, read)
    np.testing.assert_array_equal(got, data[ids])
    assert sorted(calls) == sorted(set(calls)) == sorted(set((ids // CHUNK).tolist()))
    assert got.flags.writeable


def test_part_of_a_chunk_is_its_own_copy() -> None:
    """A run inside the chunks read is copied out: a view would keep the whole chunks alive."""
    _, read = _read([])
    got = rows_by_chunks(np.arange(6, 8, dtype=np.int64), CHUNK, ROWS, read)
    assert got.base is None and got.shape == (2, 4)
