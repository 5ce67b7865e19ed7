"""The row writer of an open store: checked, encoded, chunk-aligned writes and shard marks.

Holds ``RowWriter`` (``write_rows``: true float32 rows plus their loss and count, refused
unless finite and aligned to whole chunks; ``set_done``: a shard's record, then its
``shard_done`` mark). Rows of local, uncompressed, unsharded stores go through
``direct_write``; the rest through Zarr. Transient I/O errors are retried (``retry``); what
still fails raises ``StoreUnavailableError`` (the driver retries the shard), anything else
``StoreError``.

Marking a shard done, in this order: the shard record (each chunk object's key, size and
digest: from the bytes the direct writer wrote, else read back once), then on local disks an
fsync of every chunk file and the directories up to the store's root, the record written and
synced, and last the ``shard_done`` chunk, itself written and synced. So a shard marked done
never has rows a power loss could take back (``durable``; benchmarks turn it off to measure it).
"""

from __future__ import annotations

import os
import struct
from functools import partial

import crc32c
import numpy as np

from classgrad.errors import ClassgradError, StoreError
from classgrad.store.core.encoding import encode_rows, row_maxabs
from classgrad.store.core.format import StoreSpec
from classgrad.store.core.retry import io_error, retry_transient
from classgrad.store.integrity.shard_records import (
    ShardRecord,
    chunk_digest,
    object_keys,
    record_key,
    shard_keys,
    sync_dir,
    sync_paths,
)
from classgrad.store.rows.arrays import StoreArrays
from classgrad.store.rows.direct_write import write_direct, write_file


class RowWriter:
    """Writes rows and shard marks into one open store (its ``StoreArrays``)."""

    def __init__(
        self,
        arrays: StoreArrays,
        spec: StoreSpec,
        class_ids: np.ndarray,
        *,
        records: bool = True,
        generation: str | None = None,
    ) -> None:
        self._arrays = arrays
        self._generation = generation  # the store's creation this writer opened: in every record
        self._spec = spec
        self._class_ids = class_ids
        loc = arrays.loc
        self._direct = loc.local and spec.codec == "none" and not spec.sharded
        self._records = records  # format 2; a format-1 store has no place for them
        self.durable = loc.local  # fsync before shard_done (object stores are durable per PUT)
        # key -> (size, digest) of chunks written here: by the direct path, and by Zarr's through
        # the store (``verified.DigestCheckingStore.written``), so a record vouches for the bytes
        # this writer wrote, never for what another writer left there since.
        self.written: dict[str, tuple[int, str]] = {}
        # Shard objects being written whole, read by no one meanwhile (set by the store to its
        # ``verified.DigestCheckingStore.replacing``): no request before each write.
        self.replacing: set[str] = set()

    def write_rows(self, start: int, rows: np.ndarray, *, loss: np.ndarray, count: np.ndarray) -> int:
        """See ``GradStore.write_rows``."""
        self._arrays.require_writable()
        url = self._arrays.url
        rows = np.asarray(rows)
        C, D = self._spec.num_classes, self._spec.dim
        if rows.ndim != 2 or rows.shape[1] != D:
            raise StoreError(f"write_rows: rows must have shape [n, {D}], got {list(rows.shape)}")
        start = int(start)
        n = rows.shape[0]
        stop = start + n
        if n == 0 or start < 0 or stop > C:
            raise StoreError(f"write_rows: rows [{start}, {stop}) are empty or outside [0, {C})")
        align = self._spec.write_align
        if start % align or (n % align and stop != C):
            raise StoreError(
                f"misaligned write: rows [{start}, {stop}) of {url} must start at a "
                f"multiple of {align} and cover whole chunks of {align} rows (or end at row {C})"
            )
        loss = np.asarray(loss, dtype=np.float32)
        count = np.asarray(count)
        if loss.shape != (n,) or count.shape != (n,):
            raise StoreError(
                f"write_rows: loss and count must have shape [{n}], got {list(loss.shape)} and {list(count.shape)}"
            )
        count = count.astype(np.int64, copy=False)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        dtype = self._spec.dtype
        if dtype == "float32":
            # One pass: a row sum is finite only if every value in the row is.
            maxabs = None
            with np.errstate(over="ignore", invalid="ignore"):
                sums = rows.sum(axis=1)
            bad = np.flatnonzero(~np.isfinite(sums))
            bad = bad[~np.isfinite(rows[bad]).all(axis=1)]  # a finite row may sum to inf
        else:
            maxabs = row_maxabs(rows)
            bad = np.flatnonzero(~np.isfinite(maxabs))
        if bad.size:
            row = start + int(bad[0])
            raise StoreError(
                f"write_rows: row {row} (class {int(self._class_ids[row])}) has non-finite values; refusing to store it"
            )
        stored, scale = encode_rows(rows, maxabs, dtype)
        for name, values in (("grads", stored), ("row_scale", scale), ("loss", loss), ("count", count)):
            # Whole chunks: a write sent again after a transient error stores the same bytes.
            try:
                retry_transient(
                    partial(self._write, name, start, values), f"writing {name} rows [{start}, {stop}) of {url}"
                )
            except Exception as exc:
                raise io_error(f"cannot write rows [{start}, {stop}) to {url}", exc) from None
        return stored.nbytes + scale.nbytes + loss.nbytes + count.nbytes

    def _write(self, name: str, start: int, values: np.ndarray) -> None:
        if self._direct:
            for key, size, digest in write_direct(self._arrays[name], self._arrays.loc.path, name, start, values):
                self.written[key] = (size, digest)
        elif self._spec.sharded:
            # Whole shard objects (writes cover ``write_align`` = shard rows, every column).
            arr = self._arrays[name]
            keys = set(object_keys(name, arr, (start, start + len(values))))
            self.replacing |= keys
            try:
                arr[start : start + len(values)] = values
            finally:
                self.replacing -= keys
        else:
            self._arrays[name][start : start + len(values)] = values

    def set_done(self, shard: int, value: int) -> None:
        """Set ``shard_done[shard]``: 1 once every row of the shard is written (its record and, on
        local disks, the fsyncs come first), or back to 0."""
        self._arrays.require_writable()
        rows = self._spec.shard_range(shard)  # range check
        loc = self._arrays.loc
        url = self._arrays.url

        def write() -> None:
            if value:
                record = self._record(shard, rows)
                if loc.local and self.durable:
                    sync_paths((loc.key(k) for k in record.chunks), loc.path)
                if not self._records:
                    pass
                elif loc.local:
                    self._write_local(record_key(shard), (record.to_bytes(),))
                else:
                    loc.write_bytes(record_key(shard), record.to_bytes())
            if loc.local:
                # The chunk Zarr would write (one uint8, then its crc32c), written here so it can be synced.
                data = struct.pack("<B", value)
                self._write_local(f"shard_done/c/{shard}", (data, struct.pack("<I", crc32c.crc32c(data))))
            else:
                self._arrays["shard_done"][shard] = value

        try:
            retry_transient(write, f"marking shard {shard} of {url} {'done' if value else 'not done'}")
        except ClassgradError:
            raise
        except Exception as exc:
            raise io_error(f"cannot update shard_done[{shard}] in {url}", exc) from None

    def _record(self, shard: int, rows: tuple[int, int]) -> ShardRecord:
        """The shard's record: digests of the chunks written by this writer, else read back (a
        shard whose rows an earlier writer of this store wrote)."""
        record = ShardRecord(shard, rows, generation=self._generation)
        loc = self._arrays.loc
        for key in shard_keys(self._arrays, rows):
            entry = self.written.pop(key, None)
            if entry is None:
                try:
                    data = loc.fs.cat_file(loc.key(key))
                except FileNotFoundError:
                    raise StoreError(
                        f"cannot mark shard {shard} of {self._arrays.url} done: its chunk {key} was never "
                        f"written (write every row of the shard first)"
                    ) from None
                entry = (len(data), chunk_digest(key, (data,)))
            record.chunks[key] = entry
        return record

    def _write_local(self, key: str, parts: tuple) -> None:
        path = self._arrays.loc.key(key)
        directory = os.path.dirname(path)
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        write_file(path, parts, sync=self.durable)
        if created and self.durable:
            sync_dir(os.path.dirname(directory))
