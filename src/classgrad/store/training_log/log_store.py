"""The training log's store: per-class gradient sums over windows of training steps (issue 48).

Holds ``LogSpec`` (what a log records, checked on every reopen so a resumed run never mixes
rows of another model, projection or window), ``open_log`` (a new log at ``url``, or the one
there reopened after its spec is compared), ``GradLogStore`` (a window's arrays written, then
marked done; the windows done; a resume that drops the windows at and after a step), and for
readers ``is_log`` (whether a path holds a log: what tells the commands a log from a job's
store), ``LogReader`` with ``open_log_reader`` (the spec, the done windows, one done window's
arrays read in blocks; a window not done, or past the arrays, refused in one line) and
``read_log`` (the done windows' arrays at once).

Layout (a Zarr v3 group; ``xarray.open_zarr`` reads it, ``log_dataset`` faster and checked;
dims in each array's ``dimension_names``). Window ``w`` covers steps ``[w * window, (w + 1) *
window)``:

- ``grads`` ``[window, class_id, column]`` float32: the sum over the window's steps of each
  class's row (projected to ``width`` columns, or whole); a new log stores it in shards of
  ``ROW_CHUNK`` classes with a chunk per row, only the rows a window saw (``row_shards``);
- ``lr_grads`` ``[window, class_id, column]`` float32: the same, each step's row times its
  learning rate (what a TracIn-style score sums);
- ``count`` ``[window, class_id]`` int64: the class's samples in the window's steps;
- ``loss_sum`` ``[window, class_id]`` float64: their losses summed (0 where none were given);
- ``steps`` ``[window, bound]`` int64: the first step logged and one past the last;
- group attributes: ``grad_log`` (the spec), ``done_windows`` (written only after the
  window's chunks and record are: a window not listed is absent, whatever its chunks hold) and
  ``window_records`` (true: the log keeps a record per window, ``log_records``);
- ``window_records/<w>.json``: the digest of every block of ``ROW_CHUNK`` rows of window ``w``
  (of the values, whatever the layout stores), checked on every read.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BytesCodec, ZstdCodec
from zarr.core.metadata import ArrayV3Metadata

from classgrad.errors import StoreError, StoreIncompleteError, StoreMismatchError, first_line
from classgrad.store.core.encoding import bf16_bits_to_f32, f32_to_bf16_bits
from classgrad.store.core.location import Location
from classgrad.store.integrity.lease import HeldLease, StoreLease
from classgrad.store.rows.direct_write import chunk_bytes, write_file
from classgrad.store.training_log.log_records import RECORDS_ATTR, WindowRecords, checked_rows, window_digests
from classgrad.store.training_log.row_shards import is_row_sharded, parse_shard, shard_parts, write_shard

SPEC_ATTR = "grad_log"
DONE_ATTR = "done_windows"
GENERATION_ATTR = "generation"  # a random id per creation of a log at its url
LOG_LEASE_TTL_S = 300.0  # a writer renews its lease every third of it, at a step
# How a window's sums are stored: float32, or bfloat16 (uint16 bits, the high half of float32
# rounded to nearest even: float32's range, 8 significant bits; float16 would overflow sums
# above 65,504 without per-row scales). Readers get float32 either way.
LOG_DTYPES = ("float32", "bfloat16")
SUM_ARRAYS = ("grads", "lr_grads")
# How a new log's sums are stored: "none", a Zarr shard per ROW_CHUNK classes of a window with an
# inner chunk per class row, only the rows of classes the window saw (``row_shards``); "zstd",
# dense chunks of ROW_CHUNK rows compressed (logs made before: zstd, or dense chunks, kept).
LOG_CODECS = ("none", "zstd")
ROW_CHUNK = 256  # classes per shard (or chunk) of grads: 256 x 4,096 floats is 4 MiB whole
DIMS = {
    "grads": ("window", "class_id", "column"),
    "lr_grads": ("window", "class_id", "column"),
    "count": ("window", "class_id"),
    "loss_sum": ("window", "class_id"),
    "steps": ("window", "bound"),
}


@dataclass(frozen=True)
class LogSpec:
    """``num_classes`` rows of ``width`` columns per window of ``window`` steps; ``layout``: the
    model's selected parameters (name, shape) in row order; ``projection``: the map's record
    (None: whole rows); ``model``: the caller's fingerprint of the model (e.g. its class);
    ``dtype``: how ``grads`` and ``lr_grads`` are stored (``LOG_DTYPES``)."""

    num_classes: int
    width: int
    window: int
    layout: list = field(default_factory=list)
    projection: dict | None = None
    model: str = ""
    dtype: str = "float32"  # of grads and lr_grads: float32, or bfloat16 (half the bytes; logs before: float32)

    def differences(self, other: LogSpec) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k}: the log's {_short(theirs[k])}, this run's {_short(mine[k])}" for k in mine if mine[k] != theirs[k]
        ]


def _array(group: zarr.Group, name: str, url: str = "") -> zarr.Array:
    try:
        found = group[name]
    except Exception as exc:  # missing, or a truncated or garbled zarr.json of its own
        raise StoreError(
            f"grad log {url}: the metadata of {name!r} ({name}/zarr.json) cannot be read "
            f"({first_line(exc, with_type=True)}); it is damaged"
        ) from None
    if not isinstance(found, zarr.Array):
        raise StoreError(f"grad log {url}: {name} is not an array")
    return found


def _done(group: zarr.Group, url: str = "") -> list[int]:
    listed = group.attrs.get(DONE_ATTR, [])
    if not isinstance(listed, list):
        raise StoreError(f"grad log {url}: its {DONE_ATTR} attribute is not a list of windows; it is damaged")
    bad = [w for w in listed if isinstance(w, bool) or not isinstance(w, int) or w < 0]
    if bad or len(set(listed)) != len(listed):  # 5.5 was counted as window 5, twice
        shown = bad[0] if bad else "a window listed twice"
        raise StoreError(
            f"grad log {url}: its {DONE_ATTR} attribute holds {shown!r}: not a window index; it is damaged"
        )
    return sorted(listed)


def _plain(array: zarr.Array) -> bool:
    """Whether ``array``'s chunks are their values' little-endian bytes as they are (no codec
    but the bytes serializer, dense: logs made before the row shards), which ``_write_plain``
    writes as files."""
    meta = array.metadata
    if not isinstance(meta, ArrayV3Metadata):
        return False
    codecs = meta.codecs
    return (
        len(codecs) == 1
        and isinstance(codecs[0], BytesCodec)
        and (codecs[0].endian is None or codecs[0].endian.value == "little")
        and meta.chunk_key_encoding.name == "default"
        and getattr(meta.chunk_key_encoding, "separator", "/") == "/"
    )


def _row_block(array: zarr.Array) -> int:
    """The rows of a window one object of ``array`` holds (its shard's, or its chunk's): what a
    window record's digest covers."""
    return int((array.shards or array.chunks)[1])


def _object_key(name: str, array: zarr.Array, w: int, j: int) -> str:
    """The key of window ``w``'s ``j``-th row block of ``array`` (``name/c/w/j[/0]``)."""
    return "/".join([name, "c", str(w), str(j), *["0"] * (array.ndim - 2)])


def _write_plain(array: zarr.Array, root: str, name: str, w: int, value: np.ndarray) -> None:
    """Window ``w`` of a plain local array (dense chunks, no codec: logs made before the row
    shards) written straight as its chunk files, their little-endian bytes, edge chunks padded
    with the fill value, each through a rename: zarr's pipeline wrote a window at about a tenth of
    ``numpy.save``'s speed (``benchmarks/training_log.py --parts``)."""
    rc = _row_block(array)
    for j, r0 in enumerate(range(0, value.shape[0], rc)):
        path = os.path.join(root, _object_key(name, array, w, j))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, (chunk_bytes(value[r0 : r0 + rc], array.chunks[1:], array.fill_value),))


def _write_shards(loc: Location, array: zarr.Array, name: str, w: int, value: np.ndarray) -> None:
    """Window ``w`` of a row-sharded array written straight as its shards, only the rows with a
    bit set (``row_shards``): local files through a rename, on object storage one PUT each, all
    at once (zarr's pipeline takes each one-row chunk on its own: 2.1 s against 0.18 s for a
    window at C = 10,000, k = 4,096, in a scratch timing)."""
    rc = _row_block(array)
    puts: dict[str, bytes] = {}
    for j, r0 in enumerate(range(0, value.shape[0], rc)):
        key = _object_key(name, array, w, j)
        if loc.local:
            write_shard(loc.key(key), value[r0 : r0 + rc], rc)
            continue
        parts = shard_parts(value[r0 : r0 + rc], rc)
        if parts is None:
            loc.delete(key)  # one an earlier write of the window left
        else:
            puts[key] = b"".join(parts)
    loc.write_many(puts)


def missing_windows(done: list[int]) -> list[int]:
    """The windows below the last done one that are not done: holes a resume or a kill left."""
    return sorted(set(range(done[-1] + 1)) - set(done)) if done else []


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class OpenedLog:
    """What a log's writer and its readers hold: its group, spec and url, its window records
    (None: a log made before them, read unchecked) and its location (where the sums' shards are
    written and read straight)."""

    def __init__(
        self,
        group: zarr.Group,
        spec: LogSpec,
        url: str,
        records: WindowRecords | None = None,
        storage_options: dict | None = None,
    ):
        self.group = group
        self.spec = spec
        self.url = url
        self.records = records
        self.loc = Location(url, storage_options)


class GradLogStore(OpenedLog):
    """A log opened for writing: ``write_window`` then ``mark_done``; ``done`` lists the windows."""

    def __init__(
        self,
        group: zarr.Group,
        spec: LogSpec,
        url: str,
        records: WindowRecords | None = None,
        lease: HeldLease | None = None,
        storage_options: dict | None = None,
    ):
        super().__init__(group, spec, url, records, storage_options)
        self.lease = lease  # this writer's lease on the log: one writer at a time
        self.generation = group.attrs.get(GENERATION_ATTR)  # which creation of the log at this url
        self._pending: dict[int, dict[str, list[str]]] = {}  # window -> its digests, until marked done

    def keep_alive(self) -> None:
        """Renew this writer's lease when due (each step calls it; a write every third of the TTL)."""
        if self.lease is not None:
            self.lease.keep_alive()

    def _confirm_writer(self) -> None:
        """Before a window is marked done: this writer still holds the log, and it is still the
        creation it opened; else one line (the other writer's windows stay as they are)."""
        if self.lease is not None:
            self.lease.confirm()  # LeaseHeldError if another run took the log over
        now = zarr.open_group(self.group.store, mode="r").attrs.get(GENERATION_ATTR)
        if now != self.generation:
            raise StoreMismatchError(
                f"grad log {self.url} was created again by another run since this one opened it: "
                "this run's windows are not written into it"
            )

    def close(self) -> None:
        """Give the log's lease back (a writer that stops without it leaves the lease to expire)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    @property
    def done(self) -> list[int]:
        return _done(self.group, self.url)

    def write_window(
        self,
        w: int,
        grads: np.ndarray,
        lr_grads: np.ndarray,
        count: np.ndarray,
        loss_sum: np.ndarray,
        steps: tuple[int, int],
    ) -> None:
        """Window ``w``'s arrays (the arrays grow to hold it); not done until ``mark_done``. With
        ``spec.dtype`` bfloat16, ``grads`` and ``lr_grads`` may come as their uint16 bits."""
        values = {
            "grads": self._stored(grads, w),
            "lr_grads": self._stored(lr_grads, w),
            "count": count,
            "loss_sum": loss_sum,
            "steps": np.asarray(steps, dtype=np.int64),
        }
        chunks = {}
        for name, value in values.items():
            array = _array(self.group, name, self.url)
            if array.shape[0] <= w:
                array.resize((w + 1, *array.shape[1:]))
            if is_row_sharded(array):
                _write_shards(self.loc, array, name, w, value)
            elif self.loc.local and _plain(array):
                _write_plain(array, self.loc.path, name, w, value)
            else:
                array[w] = value
            chunks[name] = _row_block(array)
        if self.records is not None:
            self._pending[w] = window_digests(w, values, chunks)

    def _stored(self, sums: np.ndarray, w: int) -> np.ndarray:
        """A window's sums as stored: float32, or bfloat16 bits (given as uint16 bits already
        rounded, or as float32; refused where they round to inf)."""
        if self.spec.dtype != "bfloat16":
            return sums.astype(np.float32, copy=False)
        bits = sums if sums.dtype == np.uint16 else f32_to_bf16_bits(sums.astype(np.float32, copy=False))
        if ((bits & np.uint16(0x7FFF)) == np.uint16(0x7F80)).any():
            raise StoreError(f"grad log {self.url}: window {w}'s sums leave bfloat16's range; not written")
        return bits

    def mark_done(self, w: int) -> None:
        """Window ``w`` done: its record first (the digests of what ``write_window`` wrote), then
        the list of done windows."""
        self._confirm_writer()
        if self.records is not None:
            self.records.write(w, self._pending.pop(w))
        self.group.attrs[DONE_ATTR] = sorted(set(self.done) | {w})

    def resume_at(self, step: int) -> None:
        """Drop the windows at and after ``step`` (a run restarted there recomputes them); a step
        inside a done window is refused (that window would mix two runs' steps)."""
        window = self.spec.window
        if step % window and (step // window) in self.done:
            raise StoreMismatchError(
                f"grad log {self.url}: step {step} is inside window {step // window} (steps "
                f"{step // window * window}-{(step // window + 1) * window - 1}), which is logged: "
                f"resume from a checkpoint at a window boundary (a multiple of {window})"
            )
        kept = [w for w in self.done if (w + 1) * window <= step]
        holes = sorted(set(range(step // window)) - set(kept))
        if holes:  # a run killed after its checkpoint but before the window was written
            first = holes[0]
            raise StoreIncompleteError(
                f"grad log {self.url}: window {first} (steps {first * window}-{(first + 1) * window - 1}) was never "
                f"written, and a resume at step {step} would leave it out for good: resume from a checkpoint "
                f"at step {first * window} or before"
            )
        self.group.attrs[DONE_ATTR] = kept


def open_log(
    url: str,
    spec: LogSpec,
    *,
    storage_options: dict | None = None,
    overwrite: bool = False,
    writer_id: str | None = None,
    lease_ttl_s: float = LOG_LEASE_TTL_S,
    codec: str = "none",
) -> GradLogStore:
    """The log at ``url``: created with ``spec``, or reopened when its recorded spec equals
    ``spec`` (else one line naming each difference; ``overwrite`` replaces it). ``writer_id``:
    the writer takes the log's lease first (a second writer is refused in one line while it is
    live; see ``classgrad.store.integrity.lease``), held until ``close``. ``codec``: how a new log's
    sums are stored: ``none`` (the default: summed float rows do not compress, and zstd cost
    most of a window's write, ``benchmarks/training_log.py --parts``; only the rows a window saw,
    in shards of one-row chunks) or ``zstd`` (dense chunks of ``ROW_CHUNK`` rows, compressed:
    what zarr's own pipeline reads fastest, for logs read mostly through xarray or dask)."""
    if codec not in LOG_CODECS:
        raise StoreError(f"grad log codec must be one of {', '.join(LOG_CODECS)}, got {codec!r}")
    lease = None
    if writer_id is not None:
        loc = Location(url, storage_options)
        loc.refuse_link()
        store_lease = StoreLease(loc, writable=True)
        store_lease.acquire(writer_id, ttl_s=lease_ttl_s, info={"command": "GradLog"})
        lease = HeldLease(store_lease, writer_id, lease_ttl_s / 3)
    try:
        return _open_log(url, spec, storage_options, overwrite, lease, codec)
    except BaseException:
        if lease is not None:
            lease.release()
        raise


def _open_log(
    url: str, spec: LogSpec, storage_options: dict | None, overwrite: bool, lease: HeldLease | None, codec: str
) -> GradLogStore:
    try:
        group = zarr.open_group(url, mode="w" if overwrite else "a", zarr_format=3, storage_options=storage_options)
    except Exception as exc:  # noqa: BLE001 - any backend's failure: one line naming the log
        raise StoreError(f"grad log {url}: cannot be opened ({type(exc).__name__}: {exc})") from None
    recorded = group.attrs.get(SPEC_ATTR)
    if recorded is None and (list(group.array_keys()) or list(group.group_keys())):
        raise StoreMismatchError(
            f"grad log {url}: the path holds a Zarr group that is not a grad log: log to another path"
        )
    if isinstance(recorded, dict):
        try:
            found = LogSpec(**recorded)
        except TypeError:
            raise StoreMismatchError(
                f"grad log {url}: its recorded spec is not one this classgrad reads ({_short(recorded)})"
            ) from None
        diffs = spec.differences(found)
        if diffs:
            raise StoreMismatchError(
                f"grad log {url} was written by another run ({'; '.join(diffs)}): "
                "log to another path, or pass overwrite=True to replace it"
            )
        for name in DIMS:  # each array's own metadata readable (one line, not a traceback later)
            _array(group, name, url)
        records = WindowRecords(url, storage_options) if group.attrs.get(RECORDS_ATTR) else None
        return GradLogStore(group, spec, url, records, lease, storage_options)
    if spec.dtype not in LOG_DTYPES:
        raise StoreError(f"grad log {url}: dtype must be one of {', '.join(LOG_DTYPES)}, got {spec.dtype!r}")
    c, k = spec.num_classes, spec.width
    stored = "uint16" if spec.dtype == "bfloat16" else "float32"
    block = (1, min(ROW_CHUNK, c), k)
    # The sums: a shard per block of classes, a chunk per class row (only the rows a window saw
    # are stored); with zstd, dense compressed chunks (zero rows compress).
    sums = {"chunks": block} if codec == "zstd" else {"chunks": (1, 1, k), "shards": block}
    layouts: dict[str, tuple[tuple[int, ...], dict[str, Any], str]] = {
        "grads": ((0, c, k), sums, stored),
        "lr_grads": ((0, c, k), sums, stored),
        "count": ((0, c), {"chunks": (1, c)}, "int64"),
        "loss_sum": ((0, c), {"chunks": (1, c)}, "float64"),
        "steps": ((0, 2), {"chunks": (1, 2)}, "int64"),
    }
    compressors = [ZstdCodec(level=3)] if codec == "zstd" else None
    for name, (shape, chunking, dtype) in layouts.items():
        group.create_array(
            name,
            shape=shape,
            dtype=dtype,
            fill_value=0,
            dimension_names=DIMS[name],
            compressors=compressors,
            **chunking,
        )
    group.attrs[SPEC_ATTR] = asdict(spec)
    group.attrs[DONE_ATTR] = []
    group.attrs[RECORDS_ATTR] = True
    group.attrs[GENERATION_ATTR] = uuid.uuid4().hex
    return GradLogStore(group, spec, url, WindowRecords(url, storage_options), lease, storage_options)


def is_log(url: str, *, storage_options: dict | None = None) -> bool:
    """Whether ``url`` holds a training log: a Zarr group with the spec attribute ``open_log``
    writes (False for a job's store, another group, or nothing readable there)."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options or None, use_consolidated=False)
    except Exception:  # noqa: BLE001 - whatever is there (or is not), it is not a log
        return False
    return isinstance(group.attrs.get(SPEC_ATTR), dict)


class LogReader(OpenedLog):
    """A log opened for reading: ``spec``, ``done`` (the windows to read), ``held`` (the windows
    the arrays hold, done or not), ``read`` (one done window of one array, or a block of it) and
    ``stacked`` (one array over the done windows). ``open_log_reader`` reads the first three
    and every array's metadata (``arrays``) as it opens the log (a damaged one is one line there),
    once: a read of a block opens no metadata again."""

    @functools.cached_property
    def arrays(self) -> dict[str, zarr.Array]:
        return {name: _array(self.group, name, self.url) for name in DIMS}

    @functools.cached_property
    def done(self) -> list[int]:
        return _done(self.group, self.url)  # once: the attribute a writer may be changing is read one time

    @functools.cached_property
    def held(self) -> int:
        return int(self.arrays["steps"].shape[0])

    @functools.cached_property
    def row_chunk(self) -> int:
        return _row_block(self.arrays["grads"])

    def check_window(self, w: int) -> None:
        """One line unless window ``w`` is done: past the arrays, or not (yet) marked done."""
        done = ", ".join(str(d) for d in self.done) or "none"
        if w < 0 or w >= self.held:
            raise StoreError(
                f"grad log {self.url}: window {w} is out of range (the log holds windows 0-{self.held - 1}; "
                f"done: {done})"
            )
        if w not in self.done:
            raise StoreIncompleteError(
                f"grad log {self.url}: window {w} is not done (its steps were not all logged, or a resume "
                f"dropped it; done windows: {done})"
            )

    def read(self, name: str, w: int, *index: slice | np.ndarray) -> np.ndarray:
        """``name``'s values of done window ``w``; ``index``: a slice or integer array per other
        dimension (each taken on its own, as ``numpy.ix_`` would)."""
        self.check_window(w)
        expected = None if self.records is None else self.records.get(w).get(name)
        if self.records is not None and expected is None:
            raise StoreError(f"grad log {self.url}: the record of window {w} has no digests of {name}")
        array = self.arrays[name]
        values = checked_rows(
            array, name, w, index, expected, self.url, _row_block(array), self._direct(array, name, w)
        )
        if self.spec.dtype == "bfloat16" and name in SUM_ARRAYS:
            return bf16_bits_to_f32(values)  # float32 true values, whatever the stored dtype
        return values

    def stacked(self, name: str) -> np.ndarray:
        """``name``'s values of every done window, stacked along ``window`` (each checked)."""
        values = [self.read(name, w) for w in self.done]
        array = self.arrays[name]
        dtype = np.float32 if name in SUM_ARRAYS else array.dtype  # sums read as float32 (bfloat16 decoded)
        return np.stack(values) if values else np.zeros((0, *array.shape[1:]), dtype=dtype)

    def _direct(self, array: zarr.Array, name: str, w: int) -> Callable[[int, int], np.ndarray] | None:
        """A row-sharded array's blocks read straight as their shards (zarr's pipeline takes each
        one-row chunk on its own: ``benchmarks/training_log.py --parts``); None: through zarr."""
        if not is_row_sharded(array):
            return None
        rc, n, row_shape = _row_block(array), int(array.shape[1]), tuple(array.shape[2:])

        def read(a: int, b: int) -> np.ndarray:
            key, rows = _object_key(name, array, w, a // rc), min(a + rc, n) - a
            block = parse_shard(self.loc.read_bytes(key), rows, rc, row_shape, array.dtype, array.fill_value)
            return block[: b - a]

        return read


def open_log_reader(url: str, *, storage_options: dict | None = None) -> LogReader:
    """The log at ``url`` opened for reading (one line if it cannot be read or is not a log)."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options or None, use_consolidated=False)
    except Exception as exc:  # noqa: BLE001 - any backend's failure: one line naming the log
        raise StoreError(f"grad log {url}: cannot be read ({type(exc).__name__}: {exc})") from None
    recorded = group.attrs.get(SPEC_ATTR)
    if not isinstance(recorded, dict):
        raise StoreError(f"grad log {url}: not a classgrad grad log (no {SPEC_ATTR!r} attribute)")
    try:
        spec = LogSpec(**recorded)
    except TypeError:
        raise StoreError(
            f"grad log {url}: its recorded spec is not one this classgrad reads ({_short(recorded)})"
        ) from None
    records = WindowRecords(url, storage_options) if group.attrs.get(RECORDS_ATTR) else None
    reader = LogReader(group, spec, url, records, storage_options)
    _ = reader.arrays, reader.done, reader.held, reader.row_chunk
    return reader


def read_log(url: str, *, storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """The done windows of the log at ``url``: ``window`` (their indices) and each array of the
    layout, restricted to them (a window written but not marked done is left out)."""
    reader = open_log_reader(url, storage_options=storage_options)
    return {"window": np.asarray(reader.done, dtype=np.int64), **{name: reader.stacked(name) for name in DIMS}}
