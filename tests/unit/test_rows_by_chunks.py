"""``indexing.rows_by_chunks``: rows gathered from whole row chunks, each read once, in any order;
a whole run of consecutive rows handed back as the chunks read, not gathered again."""

from __future__ import annotations

import numpy as np
import pytest

from classgrad.store.core.indexing import rows_by_chunks

ROWS, CHUNK = 23, 5  # the last chunk short (3 rows)
DATA = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)


def _reader(pieces: dict[int, np.ndarray]):
    def read(j: int, start: int, stop: int) -> np.ndarray:
        assert j not in pieces, f"chunk {j} read twice"
        assert (start, stop) == (j * CHUNK, min((j + 1) * CHUNK, ROWS))
        pieces[j] = DATA[start:stop].copy()  # a fresh block, as a checked read gives
        return pieces[j]

    return read


@pytest.mark.parametrize(
    "ids",
    [
        np.arange(ROWS),  # the whole array
        np.arange(5, 10),  # one whole chunk
        np.arange(20, 23),  # the short last chunk
        np.arange(3, 17),  # a run over parts of chunks
        np.array([7]),
        np.array([22, 0, 7, 7, 13]),  # any order, repeats
        np.array([4, 5]),  # consecutive across a chunk boundary
        np.array([4, 10]),  # not consecutive, though their places in the chunks read are
        np.arange(10, 5, -1),  # descending
        np.array(7),  # one id as a 0-d array: one row
    ],
)
def test_rows_equal_direct_indexing_each_chunk_read_once(ids: np.ndarray) -> None:
    pieces: dict[int, np.ndarray] = {}
    got = rows_by_chunks(ids.astype(np.int64), CHUNK, ROWS, _reader(pieces))
    np.testing.assert_array_equal(got, DATA[ids])
    assert sorted(pieces) == sorted(set((ids.reshape(-1) // CHUNK).tolist()))


def test_one_whole_chunk_comes_back_as_read() -> None:
    pieces: dict[int, np.ndarray] = {}
    got = rows_by_chunks(np.arange(5, 10), CHUNK, ROWS, _reader(pieces))
    assert got is pieces[1]  # no gather, no copy


def test_a_whole_run_of_chunks_is_their_one_concatenation() -> None:
    pieces: dict[int, np.ndarray] = {}
    got = rows_by_chunks(np.arange(ROWS), CHUNK, ROWS, _reader(pieces))
    assert got.base is None and got.flags.owndata  # the concatenation itself, not a gather of it
    assert not any(np.shares_memory(got, p) for p in pieces.values())


@pytest.mark.parametrize("ids", [np.arange(6, 8), np.arange(3, 17)])
def test_part_of_the_chunks_is_its_own_copy(ids: np.ndarray) -> None:
    """A run inside the chunks read is copied out: a view would keep the whole chunks alive."""
    pieces: dict[int, np.ndarray] = {}
    got = rows_by_chunks(ids, CHUNK, ROWS, _reader(pieces))
    assert got.base is None and got.shape == (ids.size, 4)
    assert not any(np.shares_memory(got, p) for p in pieces.values())
