"""A training log's window sums stored as Zarr shards of one-row chunks: a window keeps only the
rows of the classes it saw (issue 57, item 3).

Holds ``is_row_sharded`` (whether an array is laid out so: a shard per block of classes of a
window, an inner chunk per class row, no compression; the direct paths below need it),
``stored_rows`` (which rows of a block a shard stores: those with any bit set, so -0.0 and NaN
rows are kept, and an all-zero row reads back as the fill value it equals), ``shard_parts`` (a
block of rows as the bytes of the one shard zarr writes for it, or None where no row is stored)
with ``write_shard`` (those written as a local file), and ``parse_shard`` (a shard's rows, the
rows it does not store at the fill value).

Why: at C = 10,000 classes a window of 10 steps of 256 samples sees about a quarter of the
classes, and the dense layout wrote the other three quarters as zeros (313 MiB a window at
k = 4,096; ``benchmarks/training_log.py --parts``). Readers through zarr (numpy, dask, xarray)
get the same dense ``[window, class_id, column]`` arrays either way.

A shard's bytes (the Zarr v3 sharding codec, index at the end): the stored rows' little-endian
bytes in row order, then the index (an ``(offset, nbytes)`` uint64 pair per inner chunk, both
``2**64 - 1`` for a chunk not stored), then the index's crc32c. A test checks the files against
zarr's own writes byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import TYPE_CHECKING, Any, cast

import crc32c
import numpy as np
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
from zarr.core.metadata import ArrayV3Metadata

from classgrad.store.rows.direct_write import write_file

if TYPE_CHECKING:
    from typing_extensions import Buffer

_EMPTY = np.iinfo(np.uint64).max  # an inner chunk the shard does not store
_CRC_BYTES = 4


def is_row_sharded(array: Any) -> bool:
    """Whether ``array`` (``[window, class_id, column]``) is stored in shards of one-row inner
    chunks with no codec but the bytes serializer, the index at the end with its crc32c: the
    layout ``shard_parts`` and ``parse_shard`` write and read without zarr's pipeline."""
    meta = array.metadata
    if not isinstance(meta, ArrayV3Metadata) or len(meta.codecs) != 1 or len(meta.shape) != 3:
        return False
    codec, shard = meta.codecs[0], tuple(array.shards or ())
    return (
        isinstance(codec, ShardingCodec)
        and tuple(codec.chunk_shape) == (1, 1, meta.shape[2])
        and len(shard) == 3
        and shard[0] == 1
        and shard[2] == meta.shape[2]  # a shard: one window's block of whole rows
        and _little_bytes_only(codec.codecs)
        and len(codec.index_codecs) == 2
        and _little_bytes_only(codec.index_codecs[:1])
        and isinstance(codec.index_codecs[1], Crc32cCodec)
        and codec.index_location.value == "end"
        and meta.chunk_key_encoding.name == "default"
        and getattr(meta.chunk_key_encoding, "separator", "/") == "/"
    )


def _little_bytes_only(codecs: Any) -> bool:
    return (
        len(codecs) == 1
        and isinstance(codecs[0], BytesCodec)
        and (codecs[0].endian is None or codecs[0].endian.value == "little")
    )


def stored_rows(block: np.ndarray) -> np.ndarray:
    """Which rows of ``block`` (``[rows, ...]``) hold any set bit: the rows a shard stores."""
    bits = block.reshape(block.shape[0], -1).view(np.dtype(f"u{block.dtype.itemsize}"))
    return np.asarray(bits.any(axis=1))


def shard_parts(block: np.ndarray, rows_per_shard: int) -> list[Any] | None:
    """The shard zarr writes for ``block`` (up to ``rows_per_shard`` rows: an edge shard has
    fewer), as byte strings to write in order: runs of consecutive stored rows taken from the block
    as they are (no gathered copy), the index, its crc32c. None: no row stored, no shard (zarr
    removes one that is there)."""
    keep = stored_rows(block)
    if not keep.any():
        return None
    little = np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<"))
    row_bytes = little[0].nbytes
    index = np.full((rows_per_shard, 2), _EMPTY, dtype="<u8")
    kept = np.flatnonzero(keep)
    index[kept, 0] = np.arange(kept.size, dtype=np.uint64) * row_bytes
    index[kept, 1] = row_bytes
    # ndarray supports the buffer protocol, but numpy's stubs do not declare __buffer__.
    flat = memoryview(cast("Buffer", little.reshape(block.shape[0], -1).view(np.uint8)))
    starts = kept[np.r_[True, np.diff(kept) > 1]]
    stops = kept[np.r_[np.diff(kept) > 1, True]] + 1
    tail = index.tobytes()
    return [*(flat[a:b] for a, b in zip(starts, stops, strict=True)), tail, struct.pack("<I", crc32c.crc32c(tail))]


def write_shard(path: str, block: np.ndarray, rows_per_shard: int) -> None:
    """``block``'s shard (``shard_parts``) written as the local file ``path`` through a rename;
    with no row stored, no file (one left there by an earlier write of the window is removed)."""
    parts = shard_parts(block, rows_per_shard)
    if parts is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_file(path, tuple(parts))


def parse_shard(
    blob: bytes | None, rows: int, rows_per_shard: int, row_shape: tuple[int, ...], dtype: Any, fill: Any
) -> np.ndarray:
    """The first ``rows`` rows (``row_shape`` each) of the shard ``blob`` (None: no shard, all at
    ``fill``). A shard whose index fails its crc32c, or points outside the shard or at chunks of
    another size, raises ``ValueError`` (the caller names the log and the rows)."""
    stored, native = np.dtype(dtype).newbyteorder("<"), np.dtype(dtype).newbyteorder("=")
    # np.zeros takes pages already zeroed: a shard of a quarter of its rows is not written twice.
    # Native order, as the digests of the window's record were taken over the values written.
    out = np.zeros((rows, *row_shape), dtype=native) if fill == 0 else np.full((rows, *row_shape), fill, dtype=native)
    if blob is None:
        return out
    index_bytes = rows_per_shard * 16
    if len(blob) < index_bytes + _CRC_BYTES:
        raise ValueError(f"shard of {len(blob)} bytes is shorter than its index")
    end = len(blob) - _CRC_BYTES
    tail = blob[end - index_bytes : end]
    if struct.unpack("<I", blob[end:])[0] != crc32c.crc32c(tail):
        raise ValueError("the shard index fails its crc32c")
    index = np.frombuffer(tail, dtype="<u8").reshape(rows_per_shard, 2)[:rows]
    held = index[:, 0] != _EMPTY
    row_bytes = out[0].nbytes
    offsets, sizes = index[held, 0], index[held, 1]
    if (sizes != row_bytes).any() or (offsets + sizes > end - index_bytes).any():
        raise ValueError("the shard index points outside the shard or at chunks of another size")
    if (offsets % row_bytes).any():  # another writer's layout (zarr's own packs rows in order)
        for r, offset in zip(np.flatnonzero(held), offsets.tolist(), strict=True):
            out[r] = np.frombuffer(blob, dtype=stored, count=out[r].size, offset=offset).reshape(row_shape)
        return out
    data = np.frombuffer(blob, dtype=stored, count=(end - index_bytes) // row_bytes * out[0].size)
    out[held] = data.reshape(-1, *row_shape)[(offsets // row_bytes).astype(np.intp)]
    return out
