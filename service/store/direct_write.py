"""Row chunks written straight to files, for local, uncompressed, unsharded stores.

Holds ``write_direct``: the chunks of one array covering a run of rows, written in exactly the
Zarr v3 chunk format the array's metadata declares (the chunk's little-endian bytes, then their
crc32c as a little-endian uint32, at key ``<name>/c/<i>[/<j>]``), each through a temporary file
and a rename, as Zarr's ``LocalStore`` does. zarr-python's pipeline copies every chunk three
times (fill, merge, checksum append), which halves write throughput; a test checks these files
are byte-identical to Zarr's own.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from typing import TYPE_CHECKING, cast

import crc32c
import numpy as np
import zarr

if TYPE_CHECKING:
    from typing_extensions import Buffer


def write_direct(arr: zarr.Array, root: str, start: int, values: np.ndarray) -> None:
    """Write the chunks of ``arr`` (stored under directory ``root``) covering rows
    [start, start + len(values)); ``start`` is a multiple of the row chunk."""
    chunks = arr.chunks
    little = values.dtype.newbyteorder("<")
    root = os.path.join(root, "c")
    rc = chunks[0]
    for r0 in range(0, values.shape[0], rc):
        rows = values[r0 : r0 + rc]
        ri = (start + r0) // rc
        if values.ndim == 1:
            parts = [(root, str(ri), rows)]
        else:
            cc = chunks[1]
            row_dir = os.path.join(root, str(ri))
            parts = [(row_dir, str(c0 // cc), rows[:, c0 : c0 + cc]) for c0 in range(0, values.shape[1], cc)]
        os.makedirs(parts[0][0], exist_ok=True)
        for directory, leaf, block in parts:
            if block.shape != chunks:
                # Zarr stores edge chunks full size, padded with the fill value.
                full = np.full(chunks, arr.fill_value, dtype=little)
                full[tuple(slice(0, n) for n in block.shape)] = block
                block = full
            # ndarray supports the buffer protocol, but numpy's stubs do not declare __buffer__.
            data = memoryview(cast("Buffer", np.ascontiguousarray(block, dtype=little))).cast("B")
            path = os.path.join(directory, leaf)
            tmp = f"{path}.{uuid.uuid4().hex}.partial"
            try:
                with open(tmp, "wb") as fh:
                    fh.write(data)
                    fh.write(struct.pack("<I", crc32c.crc32c(data)))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
