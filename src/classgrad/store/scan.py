"""Chunk scanning: every chunk of every array read once, each problem reported with its kind.

Holds ``ChunkProblem`` (array, kind, one-line message, damaged shards), ``scan_chunks`` and
``scan_records`` (the done shards' recorded chunks against their sizes and digests) (behind
``GradStore.scan_chunks``, ``GradStore.verify_chunks`` and ``classgrad verify``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from classgrad.errors import CorruptChunkError, first_line
from classgrad.progress_bar import progress_bar
from classgrad.store.analysis.similarity_arrays import SimilarityArrays
from classgrad.store.core.format import ARRAYS, RESULT_ARRAYS, SIM_INDEX, StoreSpec
from classgrad.store.core.indexing import fmt_ranges, row_ranges
from classgrad.store.integrity.shard_records import (
    DIGEST,
    FOREIGN,
    ShardRecord,
    chunk_digest,
    foreign,
    record_key,
    shard_keys,
    uncovered,
)
from classgrad.store.rows.arrays import StoreArrays, is_corruption
from classgrad.store.rows.done_marks import read_done_marks
from classgrad.store.rows.raw_chunks import raw_layout, read_block

# scan_chunks reads this many elements per request at most (64 MiB of float32).
_SCAN_ELEMS = 1 << 24
_RECORD_BATCH = 4096  # records read per batch (a few MB: object storage answers them concurrently)


@dataclass(frozen=True)
class ChunkProblem:
    """One problem found by ``scan_chunks``: the array, a kind (corrupt, unreadable, missing,
    nonfinite, bad_value), a one-line message naming the chunk, and the work shards whose rows
    it damages (what ``classgrad verify --repair`` unmarks; empty for results and I/O errors)."""

    array: str
    kind: str
    message: str
    shards: tuple[int, ...] = ()
    key: str = ""  # the chunk object's key, when the problem is about one


def scan_chunks(
    arrays: StoreArrays,
    spec: StoreSpec,
    similarity: SimilarityArrays,
    *,
    records: bool = True,
    generation: str | None = None,
    fetched: dict[str, tuple[int, str]] | None = None,
    progress: bool | None = False,
) -> list[ChunkProblem]:
    """Read every chunk of every array once (results included) and report each problem
    with its kind, for ``classgrad verify`` (``progress``: a bar of chunks read, as
    ``progress_bar``'s ``show``; ``fetched``: where the store leaves the size and digest of each
    whole object it read, so the records are checked against those bytes, not read again):

    - ``corrupt``: the chunk fails its crc32c checksum or cannot be decoded;
    - ``unreadable``: the read failed for another reason (I/O);
    - ``missing``: no chunk object although its rows belong to a shard marked done (or to a
      finished similarity): those rows read as the fill value;
    - ``nonfinite``: the chunk exists and holds NaN or Inf in ``grads`` or ``loss`` rows of a
      done shard, or in a finished similarity (writers refuse them, so something bypassed
      them);
    - ``bad_value``: ``shard_done`` not 0 or 1, ``row_scale`` not positive and finite or
      ``count`` negative in a done row, a top-k index out of range.

    A NaN value and a missing chunk are told apart by asking whether the chunk object
    exists (for sharded arrays: the shard object, so a lost inner chunk of a written shard
    is reported as ``nonfinite``). A corrupt ``shard_done`` chunk counts as "not done".

    Then every done shard's record is checked (``scan_records``): each recorded object must
    exist with its recorded size and digest, so a valid chunk copied over another fails here.
    ``records``: a done shard without a record is a problem (format 2; format 1 has none).
    """
    problems: list[ChunkProblem] = []
    scan_marks = True  # through zarr, below (False: read above, or read one by one)
    raw = read_done_marks(arrays, np.arange(spec.num_shards, dtype=np.int64))
    if raw is not None:  # one plain read per mark, its values checked here (not again below)
        values, bad_marks = raw
        done = values != 0  # a value over 1 reads as done, as zarr's reader has it, and is reported
        for i in bad_marks:
            message = arrays.describe_chunk("shard_done", (i,), "crc32c checksum mismatch") + " (read as not done)"
            problems.append(ChunkProblem("shard_done", "corrupt", message, (i,)))
        for s in np.flatnonzero(values > 1).tolist():
            problems.append(ChunkProblem("shard_done", "bad_value", f"shard_done[{s}] = {values[s]} (expected 0 or 1)"))
        scan_marks = False
    else:
        done = None
    try:
        if done is None:
            done = arrays.read_all("shard_done").astype(bool)
    except CorruptChunkError:
        scan_marks = False
        done = np.zeros(spec.num_shards, dtype=bool)
        corrupt = dict(arrays.corrupt_chunks("shard_done", [(i,) for i in range(spec.num_shards)]))
        for i in range(spec.num_shards):
            if (i,) in corrupt:
                message = arrays.describe_chunk("shard_done", (i,), corrupt[(i,)]) + " (read as not done)"
                problems.append(ChunkProblem("shard_done", "corrupt", message, (i,)))
            else:
                done[i] = bool(arrays["shard_done"][i])
    done_rows = np.repeat(done, spec.shard_rows)[: spec.num_classes]
    names: list[tuple[str, np.ndarray | None]] = [(n, None if n == "shard_done" else done_rows) for n in ARRAYS]
    info = similarity.info()
    if info is not None:
        ready = np.full(spec.num_classes, info.get("state") == "ready")
        names += [(n, ready) for n in RESULT_ARRAYS if arrays.result(n) is not None]
    scanned = [(n, c) for n, c in names if n != "shard_done" or scan_marks]
    bar = progress_bar(sum(arrays[n].nchunks for n, _ in scanned), desc="verify", unit="chunk", show=progress)
    for name, checked in scanned:
        plain = raw_layout(arrays[name])
        for sel, indices, block, error in _scan_blocks(arrays[name], read=not plain):
            bar.update(len(indices))
            bad: list[tuple[tuple[int, ...], str]] = []
            if plain and error is None:
                try:
                    block, bad = read_block(arrays.loc, arrays[name], name, sel, indices, fetched)
                except Exception as exc:  # noqa: BLE001 - an I/O error: reported as unreadable below
                    error = exc
                if bad:
                    error = CorruptChunkError(bad[0][1])
            if error is not None:
                if not bad:
                    bad = arrays.corrupt_chunks(name, indices) if is_corruption(error) else []
                problems += [
                    ChunkProblem(
                        name,
                        "corrupt",
                        arrays.describe_chunk(name, i, why),
                        _shards(arrays, spec, name, i),
                        _key(arrays, name, i),
                    )
                    for i, why in bad
                ]
                if not bad:
                    problems.append(
                        ChunkProblem(
                            name,
                            "unreadable",
                            f"{name} rows [{sel[0].start}, {sel[0].stop}): cannot read: {first_line(error)}",
                        )
                    )
                continue
            problems += _scan_values(arrays, spec, name, block, sel, checked)
    bar.close()
    skip = {p.key for p in problems}
    return problems + scan_records(
        arrays,
        done,
        require=records,
        skip=skip,
        generation=generation,
        fetched=fetched,
        expected=lambda shard: shard_keys(arrays, spec.shard_range(shard)),
    )


def scan_records(
    arrays: StoreArrays,
    done: np.ndarray,
    *,
    require: bool,
    skip: set[str],
    generation: str | None = None,
    fetched: dict[str, tuple[int, str]] | None = None,
    expected: Callable[[int], list[str]] | None = None,
) -> list[ChunkProblem]:
    """Each done shard's recorded chunk objects checked against the record's size and digest,
    and the record against what it must cover (``expected``: the shard's object keys)
    (``require``: a done shard without a record is a problem too; keys in ``skip`` were reported
    already; ``generation``: the store's, whose records alone vouch). The records are read in
    batches; an object is checked against its size and digest in ``fetched`` (what a scan read
    of it) and read whole, in a batch, only when it is not there."""
    out: list[ChunkProblem] = []
    shards = np.flatnonzero(done).tolist()
    for first in range(0, len(shards), _RECORD_BATCH):
        batch = shards[first : first + _RECORD_BATCH]
        try:
            datas = arrays.loc.read_many([record_key(s) for s in batch])
        except Exception as exc:  # noqa: BLE001 - OSError, or an object storage client's own
            out.append(
                ChunkProblem(
                    "shard_records", "unreadable", f"shards {batch[0]}-{batch[-1]}'s records: {first_line(exc)}"
                )
            )
            continue
        unread: list[tuple[int, str, int, str, str]] = []  # shard, key, size, digest, digest kind
        for shard, data in zip(batch, datas):
            record = None if data is None else ShardRecord.parse(data)
            if record is None:
                if data is not None or require:
                    why = "is unreadable" if data is not None else "is missing"
                    message = f"shard {shard} is marked done but its record ({record_key(shard)}) {why}"
                    out.append(ChunkProblem("shard_records", "missing", message, (shard,)))
                continue
            if foreign(record, generation):
                out.append(ChunkProblem("shard_records", "corrupt", f"shard {shard}: {FOREIGN}", (shard,)))
                continue
            for key in uncovered(record, expected(shard)) if expected is not None else []:
                why = f"shard {shard}'s record does not cover chunk {key} (it covers less than its shard)"
                out.append(ChunkProblem("shard_records", "corrupt", why, (shard,), key))
            for key, (size, digest) in sorted(record.chunks.items()):
                if key in skip:
                    continue
                seen = fetched.get(key) if fetched is not None and record.digest == DIGEST else None
                if seen is None:
                    unread.append((shard, key, size, digest, record.digest))
                else:
                    out += _against_record(key, shard, size, digest, seen[0], seen[1])
        out += _read_and_check(arrays, unread)
    return out


def _read_and_check(arrays: StoreArrays, unread: list[tuple[int, str, int, str, str]]) -> list[ChunkProblem]:
    """Recorded objects the scan did not read whole (missing, sharded objects read by ranges,
    older records' digests), read in one batch and checked."""
    if not unread:
        return []
    found: list[bytes | None | Exception]
    try:
        found = list(arrays.loc.read_many([key for _, key, *_ in unread]))
    except Exception:  # noqa: BLE001 - one by one, to name the object that fails
        found = []
        for _, key, *_ in unread:
            try:
                found.append(arrays.loc.read_bytes(key))
            except Exception as exc:  # noqa: BLE001
                found.append(exc)
    out = []
    for (shard, key, size, digest, kind), data in zip(unread, found):
        if isinstance(data, Exception):
            out.append(ChunkProblem(key.split("/")[0], "unreadable", f"{key} (shard {shard}): {first_line(data)}"))
        elif data is None:
            out.append(
                ChunkProblem(key.split("/")[0], "missing", f"chunk {key} of shard {shard} is missing", (shard,), key)
            )
        else:
            out += _against_record(key, shard, size, digest, len(data), chunk_digest(key, (data,), kind))
    return out


def _against_record(
    key: str, shard: int, size: int, digest: str, found_size: int, found_digest: str
) -> list[ChunkProblem]:
    if found_size != size:
        why = f"has {found_size} bytes, its shard record says {size} (truncated or replaced)"
    elif found_digest != digest:
        why = "does not match its shard record's digest (damaged, or another chunk copied over it)"
    else:
        return []
    return [ChunkProblem(key.split("/")[0], "corrupt", f"chunk {key} of shard {shard} {why}", (shard,), key)]


def _key(arrays: StoreArrays, name: str, index: tuple[int, ...]) -> str:
    return arrays.chunk_key(name, index).split(" ", 1)[0]  # sharded: the shard object


def _shards(arrays: StoreArrays, spec: StoreSpec, name: str, index: tuple[int, ...]) -> tuple[int, ...]:
    """The work shards whose rows chunk ``index`` of array ``name`` holds (none for results)."""
    if name not in ARRAYS:
        return ()
    rows = arrays.chunk_slices(name, index)[0]
    if name == "shard_done":
        return tuple(range(rows.start, rows.stop))
    return tuple(range(rows.start // spec.shard_rows, (rows.stop - 1) // spec.shard_rows + 1))


def _scan_blocks(arr: zarr.Array, *, read: bool = True) -> Iterator[tuple[tuple[slice, ...], list, Any, Any]]:
    """(selection, chunk indices, values or None, exception or None) over an array, in
    reads of at most _SCAN_ELEMS elements made of whole chunks (``read``: False, the caller reads
    them itself, and values are None)."""
    rc = arr.chunks[0]
    width = 1 if arr.ndim == 1 else arr.shape[1]
    if arr.ndim == 1:
        col_bands: list[slice | None] = [None]
    else:
        cc = arr.chunks[1]
        band = max(1, _SCAN_ELEMS // (rc * cc)) * cc
        col_bands = [slice(c, min(c + band, width)) for c in range(0, width, band)]
        width = min(band, width)
    step = max(1, _SCAN_ELEMS // (rc * max(width, 1))) * rc
    for r0 in range(0, arr.shape[0], step):
        rows = slice(r0, min(r0 + step, arr.shape[0]))
        ris = range(r0 // rc, -(-rows.stop // rc))
        for cols in col_bands:
            sel = (rows,) if cols is None else (rows, cols)
            indices = (
                [(ri,) for ri in ris]
                if cols is None
                else [
                    (ri, cj) for ri in ris for cj in range(cols.start // arr.chunks[1], -(-cols.stop // arr.chunks[1]))
                ]
            )
            block, error = None, None
            try:
                if read:
                    block = arr[sel]
            except Exception as exc:  # noqa: BLE001 - classified by the caller
                error = exc
            yield sel, indices, block, error


def _scan_values(
    arrays: StoreArrays,
    spec: StoreSpec,
    name: str,
    block: np.ndarray,
    sel: tuple[slice, ...],
    checked: np.ndarray | None,
) -> list[ChunkProblem]:
    """Problems in the values of one read block (rows ``sel[0]``, columns ``sel[1]``)."""
    rows = sel[0]
    if name == "shard_done":
        return [
            ChunkProblem(name, "bad_value", f"shard_done[{rows.start + s}] = {block[s]} (expected 0 or 1)")
            for s in np.flatnonzero(block > 1)
        ]
    assert checked is not None  # only shard_done is scanned without a row mask
    mask = checked[rows]
    if not mask.any():
        return []
    if name == "grads" and spec.dtype == "bfloat16":
        bad = (block & np.uint16(0x7F80)) == np.uint16(0x7F80)  # exponent all ones
    elif name in ("count", SIM_INDEX):
        bad = (block < 0) | (block >= spec.num_classes) if name == SIM_INDEX else block < 0
    elif name == "row_scale":
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(block) & (block > 0))
    else:
        bad = ~np.isfinite(block)
    bad &= mask.reshape((-1,) + (1,) * (bad.ndim - 1))
    if not bad.any():
        return []
    arr = arrays[name]
    rc = arr.chunks[0]
    out = []
    bad_rows = bad if bad.ndim == 1 else bad.any(axis=1)
    for ri in np.unique((rows.start + np.flatnonzero(bad_rows)) // rc):
        local = slice(ri * rc - rows.start, min((ri + 1) * rc, rows.stop) - rows.start)
        parts: list[tuple[tuple[int, ...], np.ndarray]]
        if bad.ndim == 1:
            parts = [((int(ri),), bad[local])]
        else:
            c0, cc = sel[1].start, arr.chunks[1]
            parts = [
                ((int(ri), cj), bad[local, cj * cc - c0 : (cj + 1) * cc - c0])
                for cj in range(c0 // cc, -(-sel[1].stop // cc))
            ]
        for index, part in parts:
            if not part.any():
                continue
            which = rows.start + local.start + np.flatnonzero(part if part.ndim == 1 else part.any(axis=1))
            where = f"rows {fmt_ranges(row_ranges(which))}"
            if not arrays.chunk_exists(name, index):
                kind, why = "missing", "missing although its rows are marked done"
            elif name in ("row_scale", "count", SIM_INDEX):
                kind, why = "bad_value", f"{where}: invalid values ({name})"
            else:
                kind, why = "nonfinite", f"{where}: {int(part.sum())} NaN/Inf values"
            message = arrays.describe_chunk(name, index, why)
            out.append(ChunkProblem(name, kind, message, _shards(arrays, spec, name, index), _key(arrays, name, index)))
    return out
