"""Records of the similarity result's chunks: the digest of every chunk ``classgrad similarity``
writes, checked by every read of the result and by ``classgrad verify`` (issue 60, item 6).

Holds ``RECORDS_DIR``, ``chunk_digests`` (the chunks of a write -> their digests, each over the
array's name, the result's run id, the chunk's index and its values: a chunk copied from another
place or run vouches for nothing), ``ResultRecords`` (one record per write, ``similarity_records/
<run>-<start>.json``, written after its chunks; all of a run's read in one listing and one batch)
and ``checked_read`` (rows of a result array read by whole chunks, each against its digest).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from classgrad.errors import CorruptChunkError, StoreError, first_line
from classgrad.store.core.indexing import rows_by_chunks
from classgrad.store.core.location import Location
from classgrad.store.integrity.shard_records import values_digest

RECORDS_DIR = "similarity_records"


def _digest(name: str, run_id: str, j: int, values: np.ndarray) -> str:
    return values_digest(f"{name}\0{run_id}\0{j}", values)


def chunk_digests(name: str, run_id: str, start: int, values: np.ndarray, chunk_rows: int) -> dict[str, str]:
    """str(chunk index) -> digest of each whole chunk of ``values`` (rows from ``start``, a
    multiple of ``chunk_rows``)."""
    first = start // chunk_rows
    return {
        str(first + i): _digest(name, run_id, first + i, values[r : r + chunk_rows])
        for i, r in enumerate(range(0, len(values), chunk_rows))
    }


class ResultRecords:
    """The chunk records of the similarity results of one store."""

    def __init__(self, loc: Location):
        self._loc = loc
        self._cache: dict[str, dict[str, dict[str, str]]] = {}  # run id -> name -> chunk -> digest

    def write(self, run_id: str, start: int, digests: Mapping[str, Mapping[str, str]]) -> None:
        """The record of one write of run ``run_id`` (rows from ``start``): after its chunks."""
        record = {"run_id": run_id, "start": start, "digests": {k: dict(v) for k, v in digests.items()}}
        try:
            self._loc.write_bytes(f"{RECORDS_DIR}/{run_id}-{start}.json", json.dumps(record).encode())
        except Exception as exc:
            raise StoreError(
                f"cannot write a similarity record to {self._loc.url}: {first_line(exc, with_type=True)}"
            ) from None
        self._cache.pop(run_id, None)

    def of_run(self, run_id: str) -> dict[str, dict[str, str]]:
        """name -> chunk -> digest, over every record of run ``run_id``."""
        if run_id not in self._cache:
            names = sorted(
                k for k in self._loc.list_folder(RECORDS_DIR) if k.rsplit("/", 1)[-1].startswith(f"{run_id}-")
            )
            merged: dict[str, dict[str, str]] = {}
            for data in self._loc.read_many(names):
                try:
                    record = json.loads(data) if data is not None else None
                except ValueError:
                    record = None
                if not isinstance(record, dict) or record.get("run_id") != run_id:
                    continue  # unreadable: its chunks read as unrecorded, and are refused
                for name, chunks in record.get("digests", {}).items():
                    merged.setdefault(name, {}).update(chunks)
            self._cache[run_id] = merged
        return self._cache[run_id]

    def clear(self) -> None:
        """Delete every record (a new result replaces the old one)."""
        for key in self._loc.list_folder(RECORDS_DIR):
            self._loc.delete(key)
        self._cache.clear()


class ChunkUnreadable(CorruptChunkError):
    """A result chunk that cannot be read at all (its checksum or its decoding failed)."""


def checked_read(
    array: Any, name: str, ids: np.ndarray, run_id: str, expected: Mapping[str, str] | None, url: str
) -> np.ndarray:
    """Rows ``ids`` (sorted, unique) of the result ``array``, read by whole chunks, each checked
    against ``expected`` (None: a result written before records, read unchecked)."""
    if not ids.size:
        return np.empty((0, *array.shape[1:]), dtype=array.dtype)

    def read(j: int, a: int, b: int) -> np.ndarray:
        try:
            piece = np.asarray(array[a:b])
        except Exception as exc:  # its crc32c or its decoding: what the scan of verify reports too
            raise ChunkUnreadable(
                f"the similarity of {url}: {name} rows {a}-{b - 1} cannot be read "
                f"({first_line(exc, with_type=True)}); rerun `classgrad similarity`"
            ) from None
        if expected is not None and expected.get(str(j)) != _digest(name, run_id, j, piece):
            raise CorruptChunkError(
                f"the similarity of {url}: {name} rows {a}-{b - 1} do not match their "
                "record (changed, copied or never written); rerun `classgrad similarity`"
            )
        return piece

    return rows_by_chunks(ids, int(array.chunks[0]), int(array.shape[0]), read)
