"""A training log's window records: the digest of every row block (a chunk, or a shard, of 256
rows) of a window's values, written before the window is marked done and checked on every read,
as a job's store checks its shard records.

Holds ``RECORDS_ATTR`` (the log's group attribute saying it keeps records: logs made before it
are read unchecked), ``window_digests`` (a window's values -> the digest of each row chunk of
each array, bound to the array's name, the window and the chunk's position, so that a chunk
copied from another window or place cannot vouch for this one), ``WindowRecords`` (a record
per window, ``window_records/<w>.json``, written whole and read back) and ``checked_rows``
(one window's rows of an array read chunk by chunk, each chunk against its digest, then
indexed as asked).

What it catches: a deleted chunk (it reads as the fill value), a flipped byte, a chunk copied
from another window or class block, a record that lacks a chunk. Each is one ``StoreError``
naming the log, the array, the window and the rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from classgrad.errors import StoreError, first_line
from classgrad.store.core.indexing import rows_by_chunks
from classgrad.store.core.location import Location
from classgrad.store.integrity.shard_records import values_digest

RECORDS_ATTR = "window_records"  # the group attribute: this log writes a record per window
RECORDS_DIR = "window_records"


def _digest(name: str, w: int, j: int, values: np.ndarray) -> str:
    return values_digest(f"{name}\0{w}\0{j}", values)


def window_digests(w: int, values: Mapping[str, np.ndarray], row_chunks: Mapping[str, int]) -> dict[str, list[str]]:
    """name -> the digest of each row chunk (``row_chunks[name]`` rows) of window ``w``'s
    ``values[name]`` (the window's slice: ``[rows, ...]``, or ``[2]`` for ``steps``)."""
    out = {}
    for name, value in values.items():
        rc = row_chunks[name]
        rows = value.shape[0]
        out[name] = [_digest(name, w, j, value[j * rc : (j + 1) * rc]) for j in range(-(-rows // rc))]
    return out


class WindowRecords:
    """The records of one log: ``write(w, digests)`` before window ``w`` is marked done;
    ``get(w)`` its digests (read once, then kept)."""

    def __init__(self, url: str, storage_options: dict | None):
        self.url = url
        self._loc = Location(url, storage_options)
        self._cache: dict[int, dict[str, list[str]]] = {}

    def write(self, w: int, digests: dict[str, list[str]]) -> None:
        try:
            self._loc.write_bytes(f"{RECORDS_DIR}/{w}.json", json.dumps({"window": w, "digests": digests}).encode())
        except Exception as exc:
            raise StoreError(f"grad log {self.url}: cannot write the record of window {w}: {first_line(exc)}") from None
        self._cache[w] = digests

    def get(self, w: int) -> dict[str, list[str]]:
        if w not in self._cache:
            data = self._loc.read_bytes(f"{RECORDS_DIR}/{w}.json")
            try:
                record = json.loads(data) if data is not None else None
                digests = record["digests"] if isinstance(record, dict) and record.get("window") == w else None
            except ValueError:
                digests = None
            if not isinstance(digests, dict):
                raise StoreError(
                    f"grad log {self.url}: window {w} is marked done but its record is missing or damaged: "
                    "its rows cannot be vouched for (relog the window)"
                )
            self._cache[w] = digests
        return self._cache[w]


def checked_rows(
    array: Any,
    name: str,
    w: int,
    index: tuple,
    expected: list[str] | None,
    url: str,
    rows_per_block: int,
    read_rows: Callable[[int, int], np.ndarray] | None = None,
) -> np.ndarray:
    """Window ``w`` of ``array`` (``[window, rows, ...]``) at ``index`` (a slice or an integer
    array per dimension after the window's, applied each on its own), its row chunks read
    whole and each checked against ``expected`` (None: a log without records, unchecked).
    ``rows_per_block``: the rows a record's digest covers; ``read_rows``: how rows ``[a, b)`` of
    the window are read (default: through zarr)."""
    rows_index = index[0] if index else slice(None)
    n, rc = int(array.shape[1]), rows_per_block

    def through_zarr(a: int, b: int) -> np.ndarray:
        return np.asarray(array[w, a:b])

    read_rows = read_rows or through_zarr
    ids = np.arange(n)[rows_index] if isinstance(rows_index, slice) else np.asarray(rows_index, dtype=np.int64)
    if not ids.size:
        return np.asarray(array[(w, *index)])

    def read(j: int, a: int, b: int) -> np.ndarray:
        try:
            piece = read_rows(a, b)
        except Exception as exc:
            raise StoreError(
                f"grad log {url}: {name} of window {w}, rows {a}-{b - 1}, cannot be read "
                f"({first_line(exc, with_type=True)})"
            ) from None
        if expected is not None and (j >= len(expected) or _digest(name, w, j, piece) != expected[j]):
            raise StoreError(
                f"grad log {url}: {name} of window {w}, rows {a}-{b - 1}, does not match "
                "its record (deleted, changed or copied from elsewhere): relog the window"
            )
        return piece

    out = rows_by_chunks(ids, rc, n, read)
    for axis, idx in enumerate(index[1:], start=1):  # the other dimensions, each on its own
        out = np.take(out, np.arange(out.shape[axis])[idx], axis=axis)
    return out
