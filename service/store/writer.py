"""The row writer of an open store: checked, encoded, chunk-aligned writes and shard marks.

Holds ``RowWriter`` (``write_rows``: true float32 rows plus their loss and count, refused
unless finite and aligned to whole chunks; ``set_done``: a shard's ``shard_done`` mark). Rows
of local, uncompressed, unsharded stores go through ``direct_write``; the rest through Zarr.
Transient I/O errors are retried (``retry``); what still fails raises ``StoreUnavailableError``
(the driver retries the shard), anything else ``StoreError``.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np

from classgrad.service.errors import StoreError
from classgrad.service.store.arrays import StoreArrays
from classgrad.service.store.direct_write import write_direct
from classgrad.service.store.encoding import encode_rows, row_maxabs
from classgrad.service.store.format import StoreSpec
from classgrad.service.store.retry import io_error, retry_transient


class RowWriter:
    """Writes rows and shard marks into one open store (its ``StoreArrays``)."""

    def __init__(self, arrays: StoreArrays, spec: StoreSpec, class_ids: np.ndarray) -> None:
        self._arrays = arrays
        self._spec = spec
        self._class_ids = class_ids
        loc = arrays.loc
        self._direct = loc.local and spec.codec == "none" and not spec.sharded

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
            write_direct(self._arrays[name], os.path.join(self._arrays.loc.path, name), start, values)
        else:
            self._arrays[name][start : start + len(values)] = values

    def set_done(self, shard: int, value: int) -> None:
        """Set ``shard_done[shard]`` (1 once every row of the shard is durable, or back to 0)."""
        self._arrays.require_writable()
        self._spec.shard_range(shard)  # range check
        url = self._arrays.url

        def write() -> None:
            self._arrays["shard_done"][shard] = value

        try:
            retry_transient(write, f"setting shard_done[{shard}] of {url}")
        except Exception as exc:
            raise io_error(f"cannot update shard_done[{shard}] in {url}", exc) from None
