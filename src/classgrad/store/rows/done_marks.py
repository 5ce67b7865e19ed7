"""The done marks read as raw objects: one plain read per mark (one batched request on object
storage), not zarr's pipeline per chunk, which costs about 0.2 ms a mark (13 s at 62,500 shards).

Holds ``read_done_marks(arrays, shards)``: the marks of ``shards`` (their uint8 values: 1 done, 0
not; anything else is for ``classgrad verify`` to report) and the shards whose mark is corrupt,
or None when the array is not laid out as classgrad writes it (then the caller reads it through
zarr). A mark classgrad writes is 5 bytes: the uint8 flag, then its crc32c as a
little-endian uint32 (zarr's ``bytes`` then ``crc32c`` codecs, chunks of one, fill value 0, at
``shard_done/c/<shard>``): a missing object is "not done" (the fill value), a short or long one
or a checksum mismatch is corrupt.
"""

from __future__ import annotations

import struct

import crc32c
import numpy as np

from classgrad.store.rows.arrays import StoreArrays
from classgrad.store.rows.raw_chunks import raw_layout

__all__ = ["read_done_marks"]

MARK_BYTES = 5
NAME = "shard_done"


def _raw_layout(arrays: StoreArrays) -> bool:
    """Whether ``shard_done`` is stored as classgrad writes it (a hand-edited or foreign layout
    is read through zarr, which applies whatever the metadata says)."""
    arr = arrays[NAME]
    return (
        raw_layout(arr)
        and arr.chunks == (1,)
        and arr.dtype == np.uint8
        and int(getattr(arr.metadata, "fill_value", 1) or 0) == 0
    )


def read_done_marks(arrays: StoreArrays, shards: np.ndarray) -> tuple[np.ndarray, list[int]] | None:
    """(the marks' values of ``shards``, the shards whose mark is corrupt: value 0), or None
    (see the module)."""
    if not _raw_layout(arrays):
        return None
    blobs = arrays.loc.read_many([f"{NAME}/c/{int(s)}" for s in shards])
    values = np.zeros(len(blobs), dtype=np.uint8)
    corrupt: list[int] = []
    for i, blob in enumerate(blobs):
        if blob is None:
            continue  # never marked: the fill value
        if len(blob) != MARK_BYTES or struct.unpack("<I", blob[1:]) != (crc32c.crc32c(blob[:1]),):
            corrupt.append(int(shards[i]))
            continue
        values[i] = blob[0]
    return values, corrupt
