"""Row chunks written straight to files, for local, uncompressed, unsharded stores.

Holds ``write_direct``: the chunks of one array covering a run of rows, written in exactly the
Zarr v3 chunk format the array's metadata declares (the chunk's little-endian bytes, then their
crc32c as a little-endian uint32, at key ``<name>/c/<i>[/<j>]``), each through a temporary file
and a rename, as Zarr's ``LocalStore`` does; it returns each object's key, size and digest (for
the shard record, computed from the bytes in memory, never read back). zarr-python's pipeline
copies every chunk three times (fill, merge, checksum append), which halves write throughput; a
test checks these files are byte-identical to Zarr's own. Also ``chunk_bytes`` (a chunk's bytes as
Zarr lays them out, edge chunks padded; the training log's windows use it too) and ``write_file``
(one file written whole through a rename, optionally fsync'ed with its directory).
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from typing import TYPE_CHECKING, Any, cast

import crc32c
import numpy as np
import zarr

from classgrad.store.integrity.shard_records import chunk_digest, sync_dir

if TYPE_CHECKING:
    from typing_extensions import Buffer

WrittenChunk = tuple[str, int, str]  # key relative to the store root, size in bytes, digest


def write_direct(arr: zarr.Array, store_root: str, name: str, start: int, values: np.ndarray) -> list[WrittenChunk]:
    """Write the chunks of array ``name`` (``arr``, in the store at directory ``store_root``)
    covering rows [start, start + len(values)); ``start`` is a multiple of the row chunk.
    Returns (key, size, digest) of each chunk file written."""
    chunks = arr.chunks
    root = os.path.join(store_root, name, "c")
    written: list[WrittenChunk] = []
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
            data = chunk_bytes(block, chunks, arr.fill_value)
            path = os.path.join(directory, leaf)
            trailer = struct.pack("<I", crc32c.crc32c(data))
            write_file(path, (data, trailer))
            key = os.path.relpath(path, store_root).replace(os.sep, "/")
            written.append((key, data.nbytes + len(trailer), chunk_digest(key, (data, trailer))))
    return written


def chunk_bytes(block: np.ndarray, chunks: tuple[int, ...], fill: Any) -> memoryview:
    """A chunk's bytes as Zarr's bytes codec lays them out: little-endian, an edge chunk padded
    to the full chunk shape with the fill value."""
    little = block.dtype.newbyteorder("<")
    if block.shape != tuple(chunks):
        full = np.full(chunks, fill, dtype=little)
        full[tuple(slice(0, n) for n in block.shape)] = block
        block = full
    # ndarray supports the buffer protocol, but numpy's stubs do not declare __buffer__.
    return memoryview(cast("Buffer", np.ascontiguousarray(block, dtype=little))).cast("B")


def write_file(path: str, parts: tuple, *, sync: bool = False) -> None:
    """Write ``parts`` (byte strings) to ``path`` through a temporary file and a rename; with
    ``sync``, the file is fsync'ed before the rename and its directory after it."""
    tmp = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if sync:
        sync_dir(os.path.dirname(path))
