"""The arrays of an open store, read with a diagnosis: a failed read names the chunk at fault.

Holds ``StoreArrays`` (the open Zarr group, its arrays by name, their dimension names in the
store's format, ``consolidate`` (format 3's consolidated metadata), ``read`` of rows x columns, the
result arrays opened fresh, and the chunk helpers: object key, rows, which chunks fail to
decode, a chunk's one-line description, whether its object exists) and ``is_corruption`` (is a
read error a checksum or decoding failure, as opposed to an I/O problem).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import zarr

from classgrad.errors import ClassgradError, CorruptChunkError, StoreError, first_line
from classgrad.store.core.coords import consolidate
from classgrad.store.core.format import ARRAYS, FORMAT_VERSION, array_dims
from classgrad.store.core.location import Location, unreadable
from classgrad.store.core.retry import io_error, retry_transient
from classgrad.store.integrity.verified import CheckedArray, RecordedDigests


def is_corruption(exc: BaseException) -> bool:
    # Checksum and decoding failures come out of the codecs as ValueError/RuntimeError; I/O
    # problems (missing bucket, no connection) are OSErrors and must not be called corruption.
    return not isinstance(exc, (OSError, ClassgradError))


class StoreArrays:
    """The Zarr group of an open store and its arrays (``ARRAYS``, plus result arrays once
    opened with ``result``), for the reader, the writer, the similarity arrays and the scan."""

    def __init__(self, loc: Location, group: zarr.Group, mode: str, *, version: int = FORMAT_VERSION) -> None:
        self.loc = loc
        self.group = group
        self.mode = mode
        self.version = version
        self.dims = array_dims(version)  # name -> dimension names in this store's format
        self._arrays: dict[str, zarr.Array] = {}
        # What reads of recorded chunks found unlike their records (``verified``); set by the store.
        self.digests: RecordedDigests | None = None
        for name in ARRAYS:
            try:
                arr = group[name]
            except KeyError:
                raise StoreError(f"store at {loc.url} has no '{name}' array; it is damaged") from None
            except ValueError as exc:  # a truncated or garbled zarr.json: json's and zarr's own errors
                raise unreadable(loc.url, f"the metadata of '{name}' ({name}/zarr.json)", exc) from None
            if not isinstance(arr, zarr.Array):
                raise StoreError(f"store at {loc.url}: '{name}' is not an array; it is damaged")
            # Every chunk is written, even one equal to the fill value, so a written chunk
            # is never confused with a missing one (and no fill-value scan is paid per chunk).
            self._arrays[name] = arr.with_config({"write_empty_chunks": True})

    @property
    def url(self) -> str:
        return self.loc.url

    def require_writable(self) -> None:
        if self.mode == "r":
            raise StoreError(f"store {self.url} is open read-only; open it with mode='r+'")

    def consolidate(self) -> None:
        """Rewrite the consolidated metadata of a format-3 store (``coords.consolidate``), with
        retries; formats 1 and 2 have none and are left as they are (an older classgrad would
        trust a stale copy)."""
        self.require_writable()
        if self.version < 3:
            return
        try:
            retry_transient(lambda: consolidate(self.loc), f"consolidating the metadata of {self.url}")
        except Exception as exc:
            raise io_error(f"cannot write the consolidated metadata of {self.url}", exc) from None

    def __getitem__(self, name: str) -> zarr.Array:
        return self._arrays[name]

    def result(self, name: str) -> zarr.Array | None:
        """A result array, freshly opened (another process may have replaced it), or None."""
        try:
            node = self.group[name]
        except KeyError:
            self._arrays.pop(name, None)
            return None
        except Exception as exc:
            raise StoreError(f"cannot open {name} in {self.url}: {first_line(exc, with_type=True)}") from None
        if not isinstance(node, zarr.Array):
            raise StoreError(f"store {self.url}: '{name}' is not an array; it is damaged")
        arr = node.with_config({"write_empty_chunks": True})
        self._arrays[name] = arr  # lets the chunk helpers describe its chunks
        return arr

    def forget(self, name: str) -> None:
        """Drop a result array that was deleted from the group."""
        self._arrays.pop(name, None)

    def read(self, name: str, rows: np.ndarray, cols: slice | np.ndarray | None = None) -> np.ndarray:
        """Values of ``name`` at sorted unique ``rows`` (and ``cols``, a slice or sorted unique
        indices, for 2-D arrays; default all)."""
        arr = self._arrays[name]
        contiguous = rows.size > 0 and rows[-1] - rows[0] + 1 == rows.size
        sel_rows = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows
        selection = (sel_rows,) if arr.ndim == 1 else (sel_rows, slice(None) if cols is None else cols)
        try:
            # An array for slice and index-array selections (zarr's stubs also allow a scalar).
            out = cast(np.ndarray, arr.get_orthogonal_selection(selection))
            if self.digests is not None:
                self.digests.raise_failed()
            return out
        except ClassgradError:
            raise
        except Exception as exc:
            # Index columns: every column chunk of the rows is checked.
            error = self._read_error(name, rows, cols if isinstance(cols, slice) else None, exc)
            if self.digests is not None:
                # What this failed read found unlike the records is said by its error (or is its
                # cause): left noted, it would fail the next read, of other chunks.
                self.digests.failed.clear()
            raise error from None

    def lazy(self, name: str, chunks: tuple[int, ...], done: np.ndarray | None = None) -> Any:
        """``name`` as a dask array of ``chunks`` whose reads raise what its records disagree with
        (and, given the shards' ``done`` flags, a done shard read without a record)."""
        import dask.array as da

        return da.from_array(CheckedArray(self._arrays[name], self.digests, done), chunks=chunks)

    def read_all(self, name: str) -> np.ndarray:
        return self.read(name, np.arange(self._arrays[name].shape[0], dtype=np.int64))

    def chunk_key(self, name: str, index: tuple[int, ...]) -> str:
        arr = self._arrays[name]
        if arr.shards is None:
            return f"{name}/c/" + "/".join(map(str, index))
        per = [s // c for s, c in zip(arr.shards, arr.chunks)]
        outer = [i // p for i, p in zip(index, per)]
        return f"{name}/c/" + "/".join(map(str, outer)) + f" (inner chunk {tuple(index)})"

    def chunk_slices(self, name: str, index: tuple[int, ...]) -> tuple[slice, ...]:
        arr = self._arrays[name]
        return tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, arr.chunks, arr.shape))

    def chunk_exists(self, name: str, index: tuple[int, ...]) -> bool:
        key = self.chunk_key(name, index).split(" ", 1)[0]  # sharded: the shard object
        try:
            return bool(self.loc.fs.exists(self.loc.key(key)))
        except OSError:
            return True  # cannot tell: do not call it missing

    def corrupt_chunks(self, name: str, indices: list[tuple[int, ...]]) -> list[tuple[tuple, str]]:
        """Read chunks one by one; return (index, reason) of each one that fails to decode."""
        arr = self._arrays[name]
        bad = []
        for index in indices:
            try:
                arr[self.chunk_slices(name, index)]
            except Exception as exc:
                if is_corruption(exc):
                    reason = "crc32c checksum mismatch" if "checksum" in str(exc) else first_line(exc, with_type=True)
                    bad.append((index, reason))
        return bad

    def describe_chunk(self, name: str, index: tuple[int, ...], reason: str) -> str:
        rows = self.chunk_slices(name, index)[0]
        return (
            f"{name} chunk {tuple(index)} (key {self.chunk_key(name, index)}, rows "
            f"[{rows.start}, {rows.stop})): {reason}"
        )

    def _read_error(self, name: str, rows: np.ndarray, cols: slice | None, exc: Exception) -> StoreError:
        """The error to raise for a failed read: CorruptChunkError naming the first chunk that
        fails on its own, else a StoreError carrying the I/O problem."""
        arr = self._arrays[name]
        row_idx = np.unique(rows // arr.chunks[0])
        indices: list[tuple[int, ...]]
        if arr.ndim == 1:
            indices = [(int(i),) for i in row_idx]
        else:
            cols = cols or slice(0, arr.shape[1])
            col_idx = range(cols.start // arr.chunks[1], -(-cols.stop // arr.chunks[1]))
            indices = [(int(i), j) for i in row_idx for j in col_idx]
        bad = self.corrupt_chunks(name, indices) if is_corruption(exc) else []
        if bad:
            index, reason = bad[0]
            more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
            return CorruptChunkError(
                f"corrupt data in store {self.url}: {self.describe_chunk(name, index, reason)}"
                f"{more}; recompute those rows (`classgrad verify` lists every bad chunk)"
            )
        return StoreError(f"cannot read {name} from {self.url}: {first_line(exc, with_type=True)}")
