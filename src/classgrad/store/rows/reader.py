"""The row reader of an open store: true float32 values, with completeness checked.

Holds ``RowReader``: ``shard_done`` (a corrupt mark reads as "not done") and ``missing_ranges``
(completeness), ``gather`` (true
values of any rows in a column range: only rows of shards marked done, decoded with their
row_scale, a hole in a done shard reported as corruption), ``param`` (one parameter's columns),
``iter_blocks``, ``vector`` (the per-row arrays) and ``to_dask``. ``GradStore`` exposes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from classgrad.errors import ClassgradError, CorruptChunkError, StoreError, StoreIncompleteError, first_line
from classgrad.store.core.encoding import bf16_bits_to_f32, decode_rows
from classgrad.store.core.format import StoreSpec
from classgrad.store.core.indexing import fmt_ranges, row_ids, row_ranges
from classgrad.store.core.retry import io_error
from classgrad.store.rows.arrays import StoreArrays, is_corruption
from classgrad.store.rows.done_marks import read_done_marks

log = logging.getLogger(__name__)


class RowReader:
    """Reads rows of one open store (its ``StoreArrays``); see the ``GradStore`` methods."""

    def __init__(self, arrays: StoreArrays, spec: StoreSpec) -> None:
        self._arrays = arrays
        self._spec = spec
        self._layout = {e.name: e for e in spec.layout}

    def shard_done(self, shards: np.ndarray | None = None) -> np.ndarray:
        """Done flags of ``shards`` (default all). An unreadable ``shard_done`` chunk (a flipped
        bit fails its crc32c) reads as "not done", with a warning, so a run recomputes the shard.
        The marks are read as raw objects where the array is laid out as classgrad writes it
        (``done_marks``), through zarr otherwise."""
        if shards is None:
            shards = np.arange(self._spec.num_shards, dtype=np.int64)
        try:
            raw = read_done_marks(self._arrays, shards)
        except ClassgradError:
            raise
        except Exception as exc:  # OSError, and object storage clients' own errors (botocore's)
            raise io_error(f"cannot read shard_done from {self._arrays.url}", exc) from None
        if raw is not None:
            values, corrupt = raw
            for shard in corrupt:
                self._warn_corrupt_mark(shard, "crc32c checksum mismatch")
            return values != 0
        try:
            return self._arrays.read("shard_done", shards).astype(bool)
        except CorruptChunkError:
            pass
        arr = self._arrays["shard_done"]
        done = np.zeros(shards.size, dtype=bool)
        for i, shard in enumerate(shards.tolist()):
            try:
                done[i] = bool(arr[shard])
            except Exception as exc:
                if not is_corruption(exc):
                    raise StoreError(
                        f"cannot read shard_done from {self._arrays.url}: {first_line(exc, with_type=True)}"
                    ) from None
                self._warn_corrupt_mark(
                    shard, "crc32c checksum mismatch" if "checksum" in str(exc) else first_line(exc)
                )
        return done

    def _warn_corrupt_mark(self, shard: int, reason: str) -> None:
        log.warning(
            "store %s: the shard_done chunk of shard %d is corrupt (%s); treating shard %d as not done, "
            "so the next run recomputes it",
            self._arrays.url,
            shard,
            reason,
            shard,
        )

    def missing_ranges(self, done: np.ndarray | None = None) -> list[tuple[int, int]]:
        done = self.shard_done() if done is None else np.asarray(done, dtype=bool)
        s = self._spec.shard_rows
        return [(a * s, min(b * s, self._spec.num_classes)) for a, b in row_ranges(np.flatnonzero(~done))]

    def _present(self, uniq: np.ndarray, allow_missing: bool) -> np.ndarray:
        """Which of the sorted unique rows belong to done shards; raises unless allow_missing."""
        shards = uniq // self._spec.shard_rows
        done_shards = np.unique(shards)
        done = self.shard_done(done_shards)
        present = done[np.searchsorted(done_shards, shards)]
        if not allow_missing and not present.all():
            raise StoreIncompleteError(
                f"rows {fmt_ranges(row_ranges(uniq[~present]))} of store {self._arrays.url} are not "
                f"written yet (their shards are not marked done); rerun the job to finish them, "
                f"or pass allow_missing=True to get NaN rows"
            )
        return present

    def gather(self, ids: np.ndarray, cols: slice, allow_missing: bool) -> np.ndarray:
        """True float32 values of rows ``ids`` (any order, repeats allowed), columns ``cols``."""
        uniq, inverse = np.unique(ids, return_inverse=True)
        present = self._present(uniq, allow_missing)
        have = uniq[present]
        width = cols.stop - cols.start
        dtype = self._spec.dtype
        if have.size:
            scale = self._arrays.read("row_scale", have) if dtype != "float32" else None
            values = decode_rows(self._arrays.read("grads", have, cols), scale, dtype)
            digests = self._arrays.digests
            if digests is not None:  # every done shard read is vouched for by a record of this store
                digests.require(np.unique(have // self._spec.shard_rows).tolist())
                digests.raise_failed()
            holes = np.isnan(values).any(axis=1)
            if holes.any():
                raise CorruptChunkError(
                    f"rows {fmt_ranges(row_ranges(have[holes]))} of store {self._arrays.url} belong to "
                    f"shards marked done but read as never written (chunk objects missing); "
                    f"run `classgrad verify` and recompute those shards"
                )
        else:
            values = np.empty((0, width), dtype=np.float32)
        if present.all():
            out = values
        else:
            out = np.full((uniq.size, width), np.nan, dtype=np.float32)
            out[present] = values
        if uniq.size == ids.size and np.array_equal(uniq, ids):
            return out
        return out[inverse.reshape(-1)]

    def param(self, name: str, ids: Any, allow_missing: bool) -> np.ndarray:
        entry = self._layout.get(name)
        if entry is None:
            if not self._layout:
                raise StoreError(
                    f"store {self._arrays.url} holds projected rows ({self._spec.dim} dims); "
                    f"it has no per-parameter layout"
                )
            raise StoreError(f"unknown parameter {name!r}; the store holds: {', '.join(self._layout)}")
        ids = row_ids(ids, self._spec.num_classes)
        cols = slice(entry.offset, entry.offset + entry.size)
        return self.gather(ids, cols, allow_missing).reshape((ids.size, *entry.shape))

    def iter_blocks(self, rows_per_block: int, allow_missing: bool) -> Iterator[tuple[int, np.ndarray]]:
        if rows_per_block < 1:
            raise StoreError(f"rows_per_block must be positive, got {rows_per_block}")
        C, dim = self._spec.num_classes, self._spec.dim
        step = rows_per_block
        if step >= self._spec.row_chunk:
            step -= step % self._spec.row_chunk
        if not allow_missing:
            missing = self.missing_ranges()
            if missing:
                raise StoreIncompleteError(
                    f"rows {fmt_ranges(missing)} of store {self._arrays.url} are not written yet; "
                    f"rerun the job to finish them, or pass allow_missing=True for NaN rows"
                )
        for start in range(0, C, step):
            stop = min(start + step, C)
            yield start, self.gather(np.arange(start, stop, dtype=np.int64), slice(0, dim), allow_missing)

    def vector(self, name: str, ids: Any) -> np.ndarray:
        """A per-row array (loss, count, row_scale) at rows ``ids``."""
        ids = row_ids(ids, self._spec.num_classes)
        uniq, inverse = np.unique(ids, return_inverse=True)
        if uniq.size == 0:
            return np.empty(0, dtype=self._arrays[name].dtype)
        return self._arrays.read(name, uniq)[inverse.reshape(-1)]

    def to_dask(self, done: np.ndarray | None = None):  # -> dask.array.Array (dask is optional)
        """``done``: the done flags when the caller has read them already (one read of the marks)."""
        try:
            import dask.array as da
        except ImportError:
            raise StoreError("to_dask needs dask: pip install 'classgrad[read]'") from None
        dtype = self._spec.dtype
        grads = self._arrays["grads"]
        unit = grads.shards or grads.chunks
        flags = self.shard_done() if done is None else np.asarray(done, dtype=bool)
        x = self._arrays.lazy("grads", unit, flags)
        if dtype != "float32":
            scale = self._arrays.lazy("row_scale", (unit[0],), flags)
            if dtype == "bfloat16":
                x = x.map_blocks(bf16_bits_to_f32, dtype=np.float32)
            else:
                x = x.astype(np.float32)
            x = x * scale[:, None]
        per_row = np.repeat(flags, self._spec.shard_rows)[: self._spec.num_classes]
        if not per_row.all():
            x = da.where(da.from_array(per_row, chunks=(unit[0],))[:, None], x, np.float32(np.nan))
        return x
