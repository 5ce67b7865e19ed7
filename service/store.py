"""The Zarr v3 gradient store: schema, chunk-aligned writer, reader for downstream jobs.

Holds ``FORMAT_VERSION``, ``ParamEntry`` (one selected parameter in row order), ``StoreSpec``
(everything needed to create a store), ``create_store`` (driver only), ``open_store`` (workers
with ``mode="r+"``, readers with ``mode="r"``) and ``GradStore`` (metadata, the row writer,
completeness, the reader, a dask view, the run history, the driver's lease and
``verify_chunks``), and, in the section "downstream results" at the end: ``GradStore.block``
and ``GradStore.rows_band`` (rows x a column range, the unit of out-of-core jobs), the
similarity arrays (``begin_similarity``, ``write_similarity_rows``, ``finish_similarity``,
``similarity_info``, ``similarity``, ``similarity_neighbours``), ``GradStore.scan_chunks`` with
``ChunkProblem`` and ``check_metadata`` (the structured checks of ``classgrad verify``). This is
the only module that knows key names and layout. It needs numpy, zarr and fsspec only (s3fs for
``s3://``; dask for ``to_dask``), never torch or Ray.

Layout of a store (a Zarr v3 group)::

    zarr.json         group metadata; all classgrad metadata under attributes["classgrad"]
    grads/            (C, D) float32 | float16 | uint16 (bfloat16 bits), chunks (row_chunk,
                      col_chunk)
    row_scale/        (C,) float32, chunks (row_chunk,): true row = stored row * row_scale
    loss/             (C,) float32, chunks (row_chunk,): L_c at theta
    count/            (C,) int64, chunks (row_chunk,): probe samples behind row c
    shard_done/       (num_shards,) uint8, chunks (1,): 1 once every row of the shard is stored
    lease.json        the running driver's lease (plain JSON, not Zarr; readers ignore it)
  written by ``classgrad similarity`` (optional; replaced whole by each run):
    similarity/       (C, C) float32, chunks (chunk_rows, C) (row blocks; chunk_rows divides
                      row_chunk), fill NaN: cosine or dot product of rows i and j. Its own
                      attributes: metric, state ("computing" until the run finishes, then
                      "ready"; readers refuse anything else), top_k, chunk_rows,
                      source_fingerprint (the store's fingerprint when computed), run_id, timings
    similarity_topk_index/  (C, top_k) int64, chunks (chunk_rows, top_k), fill -1: row indices
                      of each row's most similar rows, best first, ties by lower index, self
                      excluded (absent when top_k is 0)
    similarity_topk_value/  (C, top_k) float32: their similarity values

Dimension names: ``grads`` (class, param), the per-row arrays (class,), ``shard_done`` (shard),
``similarity`` (class, other_class), the top-k arrays (class, neighbour).
Row i holds class ``class_ids[i]``. Fill values mark what was never written: NaN for
``grads`` (bfloat16: the NaN bit pattern 0x7FC0), ``row_scale`` and ``loss``; -1 for
``count``; 0 for ``shard_done``. Writers refuse non-finite rows, so a NaN inside a done shard
means a missing chunk. Every chunk ends with a crc32c checksum (Zarr's ``crc32c`` codec, last
in the pipeline, after zstd or blosc when asked); a failing chunk raises
``CorruptChunkError`` naming the array, chunk index and object key. With ``sharded`` the
arrays use Zarr's sharding codec: one Zarr shard (one object) = (shard_rows, col_chunk), and
writes must then cover whole work shards (``GradStore.write_align``). Local, uncompressed,
unsharded stores write their row chunks directly as files in exactly the chunk format the
metadata declares (about twice as fast as zarr-python's pipeline; tests check the files are
byte-identical to Zarr's); everything else goes through zarr-python.

``attributes["classgrad"]`` (JSON) holds: ``format_version``; ``state`` ("creating" until every
array exists, then "ready"); ``num_classes``, ``dim``, ``shard_rows``, ``num_shards``,
``row_chunk``, ``col_chunk``; ``dtype`` (float32 | float16 | bfloat16), ``storage_dtype``,
``scaling`` and ``encoding`` (plain-text descriptions of the two rules below); ``codec`` and
``checksum``; ``sharded``; ``class_ids`` (null means row i is class i) and ``class_names``
(or null); ``layout`` (list of {name, shape, offset, size}; empty when projected);
``projection`` (or null); ``loss_kind``; ``config`` (the job config, redacted by the caller);
``fingerprint``; ``versions``; ``runs`` (run history, appended by the driver). Storage options
(credentials, endpoints) are never written anywhere in the store.

Low precision: each row is stored as g / row_scale with a power-of-two row_scale chosen so
that the row's max |value| lies in [2**13, 2**14): float16 cannot overflow (max 65504) and
rows of tiny gradients (all below 1e-6) are lifted out of float16's subnormal range; the
scale is exact, so true = stored * row_scale. All-zero rows get scale 1; float32 rows get
scale 1 and are bit-exact. bfloat16 is stored as uint16 bits, the high half of the float32
bits after round-to-nearest-even; decode with ``(bits.astype(uint32) << 16).view(float32)``.

Reading without classgrad (``path`` is the store directory)::

    g = zarr.open_group(path, mode="r")
    scale = g["row_scale"][:][:, None]
    true = g["grads"][:] * scale                                    # float32 / float16
    true = (g["grads"][:].astype("uint32") << 16).view("float32") * scale   # bfloat16
    dask.array.from_zarr(path, component="grads")                   # stored values, lazily
    xarray.open_zarr(path, consolidated=False)                      # Dataset of stored values
    xarray.DataArray(store.to_dask(), dims=("class", "param"),
                     coords={"class": store.class_ids})             # true values, lazily
    tensorstore.open({"driver": "zarr3",
                      "kvstore": {"driver": "file", "path": f"{path}/grads"}}).result()

Locations: a plain path or ``file://`` (Zarr ``LocalStore``), ``s3://bucket/path`` through
fsspec/s3fs with ``storage_options`` (``endpoint_url`` or ``client_kwargs``; credentials from
the environment or the options, never stored), ``memory://`` for tests.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c
import fsspec
import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.storage import FsspecStore, LocalStore

from classgrad.service.errors import (
    ClassgradError,
    CorruptChunkError,
    LeaseHeldError,
    StoreError,
    StoreIncompleteError,
    StoreMismatchError,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

_ATTR_KEY = "classgrad"
_LEASE_KEY = "lease.json"
_ARRAYS = ("grads", "row_scale", "loss", "count", "shard_done")
_STORAGE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
_CODECS = ("none", "zstd", "blosc")
_BF16_NAN = 0x7FC0
# A row's max |stored value| is kept below 2**_TOP_EXP: float16 tops out at 65504 (~2**16),
# so two binades of headroom keep rounding and later arithmetic from overflowing.
_TOP_EXP = 14
# Attributes that must match, besides the fingerprint, for a store to be reopened.
_STRUCTURE_KEYS = (
    "num_classes", "dim", "shard_rows", "row_chunk", "col_chunk", "dtype", "codec", "sharded",
    "layout", "class_ids", "projection",
)
_OVERWRITE_HINT = "--set store.overwrite=true"


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class ParamEntry:
    """One selected parameter: its columns are [offset, offset + size) of every row."""

    name: str
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclass(frozen=True)
class StoreSpec:
    """Everything ``create_store`` needs; checked on construction (errors name the field)."""

    num_classes: int
    dim: int
    shard_rows: int
    row_chunk: int = 16
    col_chunk: int = 1 << 20
    dtype: str = "float32"
    codec: str = "none"
    sharded: bool = False
    layout: tuple[ParamEntry, ...] = ()
    class_ids: tuple[int, ...] | None = None
    class_names: tuple[str, ...] | None = None
    loss_kind: str = ""
    projection: dict | None = None
    config: dict = field(default_factory=dict)
    fingerprint: str = ""
    versions: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> StoreError:
            return StoreError(f"store spec: {name} {why}")

        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("num_classes", "dim", "shard_rows", "row_chunk", "col_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise bad(name, f"must be a positive integer, got {value!r}")
            put(name, int(value))
        if self.shard_rows % self.row_chunk:
            raise bad("shard_rows", f"({self.shard_rows}) must be a multiple of row_chunk "
                                    f"({self.row_chunk})")
        put("col_chunk", min(self.col_chunk, self.dim))
        if self.dtype not in _STORAGE_DTYPES:
            raise bad("dtype", f"must be one of {', '.join(_STORAGE_DTYPES)}, got {self.dtype!r}")
        if self.codec not in _CODECS:
            raise bad("codec", f"must be one of {', '.join(_CODECS)}, got {self.codec!r}")
        put("sharded", bool(self.sharded))
        put("layout", tuple(_param_entry(e) for e in self.layout))
        # The checks ``classgrad verify`` runs on stored metadata; each problem starts with
        # the field it is about ("layout ...", "projection ...").
        problems = _check_layout([asdict(e) for e in self.layout], self.projection, self.dim)
        if problems:
            raise StoreError(f"store spec: {problems[0]}")
        if self.class_ids is not None:
            ids = tuple(int(i) for i in self.class_ids)
            if len(ids) != self.num_classes:
                raise bad("class_ids", f"has {len(ids)} entries, expected num_classes "
                                       f"({self.num_classes})")
            if len(set(ids)) != len(ids):
                raise bad("class_ids", "has duplicates")
            put("class_ids", ids)
        if self.class_names is not None:
            names = tuple(str(n) for n in self.class_names)
            if len(names) != self.num_classes:
                raise bad("class_names", f"has {len(names)} entries, expected num_classes "
                                         f"({self.num_classes})")
            put("class_names", names)
        for name in ("config", "versions", "projection"):
            try:
                json.dumps(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise bad(name, f"is not JSON-serializable: {exc}") from None

    @property
    def num_shards(self) -> int:
        return -(-self.num_classes // self.shard_rows)


def _param_entry(entry: ParamEntry | dict) -> ParamEntry:
    if isinstance(entry, dict):
        entry = ParamEntry(**entry)
    return ParamEntry(str(entry.name), tuple(int(s) for s in entry.shape), int(entry.offset),
                      int(entry.size))


def _spec_to_meta(spec: StoreSpec) -> dict:
    low = spec.dtype != "float32"
    meta = {
        "format_version": FORMAT_VERSION,
        "state": "creating",
        "num_classes": spec.num_classes,
        "dim": spec.dim,
        "shard_rows": spec.shard_rows,
        "num_shards": spec.num_shards,
        "row_chunk": spec.row_chunk,
        "col_chunk": spec.col_chunk,
        "dtype": spec.dtype,
        "storage_dtype": _STORAGE_DTYPES[spec.dtype],
        "scaling": ("per-row power-of-two row_scale: true row = stored row * row_scale "
                    f"(max |stored| < 2**{_TOP_EXP})") if low else "none (row_scale = 1)",
        "encoding": ("bfloat16 stored as uint16 bits, high half of float32 "
                     "(round to nearest even)") if spec.dtype == "bfloat16" else spec.dtype,
        "codec": spec.codec,
        "checksum": "crc32c",
        "sharded": spec.sharded,
        "class_ids": list(spec.class_ids) if spec.class_ids is not None else None,
        "class_names": list(spec.class_names) if spec.class_names is not None else None,
        "layout": [{"name": e.name, "shape": list(e.shape), "offset": e.offset, "size": e.size}
                   for e in spec.layout],
        "projection": spec.projection,
        "loss_kind": spec.loss_kind,
        "config": spec.config,
        "fingerprint": spec.fingerprint,
        "versions": {"numpy": np.__version__, "zarr": zarr.__version__, **spec.versions},
        "runs": [],
    }
    # Normalise through JSON (tuples -> lists) so comparisons with stored attributes are exact.
    return json.loads(json.dumps(meta))


def _spec_from_meta(meta: dict) -> StoreSpec:
    return StoreSpec(
        num_classes=meta["num_classes"], dim=meta["dim"], shard_rows=meta["shard_rows"],
        row_chunk=meta["row_chunk"], col_chunk=meta["col_chunk"], dtype=meta["dtype"],
        codec=meta["codec"], sharded=meta["sharded"],
        layout=tuple(_param_entry(e) for e in meta["layout"]),
        class_ids=tuple(meta["class_ids"]) if meta["class_ids"] is not None else None,
        class_names=tuple(meta["class_names"]) if meta["class_names"] is not None else None,
        loss_kind=meta["loss_kind"], projection=meta["projection"], config=meta["config"],
        fingerprint=meta["fingerprint"], versions=meta["versions"],
    )


# --------------------------------------------------------------------------- encoding


def _row_maxabs(rows: np.ndarray) -> np.ndarray:
    """Per-row max |value|; NaN or inf where a row has a non-finite value (max/min propagate)."""
    return np.maximum(rows.max(axis=1), -rows.min(axis=1))


def _row_scales(maxabs: np.ndarray) -> np.ndarray:
    """Power-of-two scales putting each row's max |value| in [2**(_TOP_EXP-1), 2**_TOP_EXP)."""
    _, exp = np.frexp(maxabs)  # maxabs = m * 2**exp with 0.5 <= m < 1
    # Clipped to float32's normal exponents so the scale itself is an exact float32.
    scale = np.ldexp(np.float32(1.0), np.clip(exp - _TOP_EXP, -126, 127)).astype(np.float32)
    scale[maxabs == 0] = 1.0
    return scale


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low half.
    bits = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (bits >> np.uint32(16)).astype(np.uint16)


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _encode_rows(rows: np.ndarray, maxabs: np.ndarray | None,
                 dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """True float32 rows (and their max |value|, for low precision) -> (stored, row_scale)."""
    if dtype == "float32":
        return rows, np.ones(rows.shape[0], dtype=np.float32)
    scale = _row_scales(maxabs)
    scaled = rows * (np.float32(1.0) / scale)[:, None]  # exact: scale is a power of two
    if dtype == "float16":
        return scaled.astype(np.float16), scale
    return _f32_to_bf16_bits(scaled), scale


def _decode_rows(stored: np.ndarray, scale: np.ndarray | None, dtype: str) -> np.ndarray:
    """Stored values (+ row_scale) -> true float32 rows."""
    if dtype == "float32":
        return stored
    out = stored.astype(np.float32) if dtype == "float16" else _bf16_bits_to_f32(stored)
    out *= scale[:, None]
    return out


# --------------------------------------------------------------------------- helpers


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _ranges(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted row ids -> merged [start, stop) ranges."""
    if sorted_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [sorted_ids.size]))
    return [(int(sorted_ids[a]), int(sorted_ids[b - 1]) + 1) for a, b in zip(starts, stops)]


def fmt_ranges(ranges: list[tuple[int, int]], limit: int = 5) -> str:
    """``[a, b), [c, d)``: the first ``limit`` ranges, then "and N more"."""
    text = ", ".join(f"[{a}, {b})" for a, b in ranges[:limit])
    if len(ranges) > limit:
        text += f" and {len(ranges) - limit} more"
    return text


def _is_corruption(exc: BaseException) -> bool:
    # Checksum and decoding failures come out of the codecs as ValueError/RuntimeError; I/O
    # problems (missing bucket, no connection) are OSErrors and must not be called corruption.
    return not isinstance(exc, (OSError, ClassgradError))


def local_path(url: str) -> str | None:
    """The raw path part of a local store URL (``file://PATH`` or a plain path), as given (not
    expanded nor made absolute); None for any other scheme (``s3://``, ``memory://``...)."""
    if "://" in url and not url.startswith("file://"):
        return None
    return url[len("file://"):] if url.startswith("file://") else url


class _Location:
    """Where a store lives: the Zarr store object plus an fsspec view for the lease file."""

    def __init__(self, url: str, storage_options: dict | None) -> None:
        if not isinstance(url, str) or not url:
            raise StoreError(f"store url must be a non-empty string, got {url!r}")
        self.url = url
        self.options = dict(storage_options or {})
        path = local_path(url)
        self.local = path is not None
        if self.local:
            self.path = os.path.abspath(os.path.expanduser(path))
            self.fs = fsspec.filesystem("file")
        else:
            try:
                self.fs, self.path = fsspec.core.url_to_fs(url, **self.options)
            except (ImportError, ValueError, TypeError) as exc:
                raise StoreError(f"cannot use store location {url}: {_one_line(exc)}") from None
            self.path = self.path.rstrip("/")

    def zarr_store(self, *, read_only: bool) -> zarr.abc.store.Store:
        if self.local:
            return LocalStore(self.path, read_only=read_only)
        return FsspecStore.from_url(self.url, storage_options=self.options or None,
                                    read_only=read_only)

    def key(self, name: str) -> str:
        return f"{self.path}/{name}"

    def is_empty(self) -> bool:
        if self.local:
            return not os.path.exists(self.path) or (
                os.path.isdir(self.path) and not os.listdir(self.path))
        self.fs.invalidate_cache()  # s3fs caches listings; a stale one could hide data
        try:
            return not self.fs.ls(self.path)
        except FileNotFoundError:
            return True

    def why_absent(self) -> str:
        """Why nothing was found: a missing bucket is worth naming."""
        bucket = self.path.split("/", 1)[0]
        if not self.local and bucket:
            try:
                if not self.fs.exists(bucket):
                    return f"bucket {bucket!r} does not exist"
            except OSError:
                pass
        return "no Zarr group there"

    def remove_all(self) -> None:
        if self.local:
            shutil.rmtree(self.path, ignore_errors=False)
        else:
            self.fs.rm(self.path, recursive=True)
            self.fs.invalidate_cache()

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.key(name))
        except FileNotFoundError:
            return None

    def write_bytes(self, name: str, data: bytes) -> None:
        if self.local:
            # Write then rename, so a reader never sees half a file.
            tmp = self.key(f".{name}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.key(name))
        else:
            self.fs.pipe_file(self.key(name), data)  # one PUT: atomic on object storage

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.key(name))
        except FileNotFoundError:
            pass


def _probe(loc: _Location) -> tuple[str, dict | None]:
    """What is at a location: 'empty', 'other', 'creating' or 'ready' (+ classgrad metadata)."""
    try:
        group = zarr.open_group(loc.zarr_store(read_only=True), mode="r", zarr_format=3)
    except FileNotFoundError:  # also zarr's GroupNotFoundError
        return ("empty" if loc.is_empty() else "other"), None
    except (zarr.errors.ContainsArrayError, zarr.errors.NodeTypeValidationError):
        return "other", None
    except Exception as exc:
        raise StoreError(f"cannot read store location {loc.url}: {_one_line(exc)}") from None
    meta = group.attrs.get(_ATTR_KEY)
    if not isinstance(meta, dict):
        return "other", None
    return ("ready" if meta.get("state") == "ready" else "creating"), meta


def _read_lease(loc: _Location) -> dict | None:
    try:
        data = loc.read_bytes(_LEASE_KEY)
    except OSError as exc:
        raise StoreError(f"cannot read the lease of {loc.url}: {_one_line(exc)}") from None
    if data is None:
        return None
    try:
        lease = json.loads(data)
    except ValueError:
        log.warning("ignoring an unreadable lease file in %s", loc.url)
        return None
    return lease if isinstance(lease, dict) else None


def _lease_age(lease: dict, now: float) -> float:
    return now - float(lease.get("heartbeat", 0))


def _holder_gone(lease: dict) -> bool:
    """True when the lease's driver ran on this host and its process no longer exists.

    A killed driver (SIGKILL, OOM) cannot release its lease; on the same host that is
    provable at once, so a rerun need not wait for the heartbeat to age past the TTL.
    """
    if lease.get("host") != socket.gethostname() or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


def _held_message(url: str, lease: dict, now: float) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("started", 0)))
    return (f"store {url} is in use by run {lease.get('run_id')!r} (host {lease.get('host')}, "
            f"pid {lease.get('pid')}, started {started}, last heartbeat "
            f"{_lease_age(lease, now):.0f}s ago); wait for it to finish or stop it")


def _codecs(codec: str) -> list:
    compressors: list = []
    if codec == "zstd":
        compressors.append(ZstdCodec(level=3))
    elif codec == "blosc":
        compressors.append(BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"))
    compressors.append(Crc32cCodec())  # last, so the stored bytes themselves are checked
    return compressors


def _array_table(num_classes: int, dim: int, row_chunk: int, col_chunk: int, num_shards: int,
                 storage_dtype: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]:
    """name -> (shape, chunks, dtype) of a store's arrays, in ``_ARRAYS`` order: what
    ``_create`` makes and ``_check_arrays`` expects."""
    C, rc = num_classes, row_chunk
    return {
        "grads": ((C, dim), (rc, col_chunk), storage_dtype),
        "row_scale": ((C,), (rc,), "float32"),
        "loss": ((C,), (rc,), "float32"),
        "count": ((C,), (rc,), "int64"),
        "shard_done": ((num_shards,), (1,), "uint8"),
    }


_ARRAY_DIMS = {"grads": ("class", "param"), "row_scale": ("class",), "loss": ("class",),
               "count": ("class",), "shard_done": ("shard",)}


def _create(loc: _Location, spec: StoreSpec) -> None:
    meta = _spec_to_meta(spec)
    fills = {"grads": _BF16_NAN if spec.dtype == "bfloat16" else np.nan, "row_scale": np.nan,
             "loss": np.nan, "count": -1, "shard_done": 0}
    table = _array_table(spec.num_classes, spec.dim, spec.row_chunk, spec.col_chunk,
                         spec.num_shards, _STORAGE_DTYPES[spec.dtype])
    try:
        # The group is written first with state "creating" and flipped to "ready" last, so an
        # interrupted creation is recognised (and redone) instead of trusted.
        group = zarr.create_group(loc.zarr_store(read_only=False), zarr_format=3,
                                  attributes={_ATTR_KEY: meta})
        for name, (shape, chunks, dtype) in table.items():
            # Sharded stores keep one object per work shard (all its rows) per column chunk.
            shards = (spec.shard_rows, *chunks[1:]) if spec.sharded and name != "shard_done" \
                else None
            group.create_array(
                name, shape=shape, chunks=chunks, shards=shards, dtype=dtype,
                fill_value=fills[name], serializer=BytesCodec(endian="little"),
                compressors=_codecs(spec.codec if name != "shard_done" else "none"),
                dimension_names=_ARRAY_DIMS[name],
            )
        meta["state"] = "ready"
        group.update_attributes({_ATTR_KEY: meta})
    except ClassgradError:
        raise
    except Exception as exc:
        raise StoreError(f"cannot create store at {loc.url}: {_one_line(exc)}") from None


def _check_same(meta: dict, spec: StoreSpec, url: str) -> None:
    old_fp = meta.get("fingerprint")
    if old_fp != spec.fingerprint:
        raise StoreMismatchError(
            f"store at {url} was made by another config (its fingerprint {old_fp!r}, this "
            f"config's {spec.fingerprint!r}); use another store.url, or replace it with "
            f"{_OVERWRITE_HINT}")
    new = _spec_to_meta(spec)
    differ = [k for k in _STRUCTURE_KEYS if meta.get(k) != new[k]]
    if differ:
        raise StoreMismatchError(
            f"store at {url} has this config's fingerprint {old_fp!r} but a different "
            f"{', '.join(differ)}; replace it with {_OVERWRITE_HINT}")


# --------------------------------------------------------------------------- public API


def create_store(url: str, spec: StoreSpec, *, storage_options: dict | None = None,
                 overwrite: bool = False) -> GradStore:
    """Driver only: create the store (group, arrays, attributes, once) or reopen it to resume.

    An existing store with the same fingerprint is reopened and nothing is rewritten; one with
    another fingerprint raises ``StoreMismatchError``; ``overwrite=True`` deletes it and creates
    a new one. A location holding anything that is not a classgrad store is never touched.
    """
    if not isinstance(spec, StoreSpec):
        raise StoreError(f"create_store needs a StoreSpec, got {type(spec).__name__}")
    loc = _Location(url, storage_options)
    state, meta = _probe(loc)
    if state == "other":
        raise StoreError(f"{url} already holds something that is not a classgrad store; "
                         f"refusing to write there (choose another store.url)")
    if state == "ready" and not overwrite:
        _check_same(meta, spec, url)
        log.info("reopening store %s to resume (fingerprint %s)", url, spec.fingerprint)
        return GradStore(loc, "r+")
    if state == "ready":
        lease, now = _read_lease(loc), time.time()
        if lease and _lease_age(lease, now) < float(lease.get("ttl_s", 0)):
            raise LeaseHeldError(f"cannot overwrite: {_held_message(url, lease, now)}")
        log.warning("overwrite: deleting store %s (fingerprint %s)", url, meta.get("fingerprint"))
    elif state == "creating":
        log.warning("store %s was left half-created by an interrupted run; recreating it", url)
    if state != "empty":
        try:
            loc.remove_all()
        except OSError as exc:
            raise StoreError(f"cannot delete old store at {url}: {_one_line(exc)}") from None
    _create(loc, spec)
    log.info("created store %s: %d x %d %s, %d shards of %d rows", url, spec.num_classes,
             spec.dim, spec.dtype, spec.num_shards, spec.shard_rows)
    return GradStore(loc, "r+")


def open_store(url: str, *, storage_options: dict | None = None, mode: str = "r") -> GradStore:
    """Open an existing store: ``mode="r"`` for readers, ``mode="r+"`` for workers."""
    if mode not in ("r", "r+"):
        raise StoreError(f"open_store: mode must be 'r' or 'r+', got {mode!r}")
    return GradStore(_Location(url, storage_options), mode)


class GradStore:
    """An open store. Build it with ``create_store`` or ``open_store``."""

    def __init__(self, loc: _Location, mode: str) -> None:
        self._loc = loc
        self._mode = mode
        url = loc.url
        if loc.local and not os.path.isdir(loc.path):
            raise StoreError(f"no classgrad store at {url} (no such directory)")
        try:
            self._group = zarr.open_group(loc.zarr_store(read_only=mode == "r"), mode=mode,
                                          zarr_format=3)
        except FileNotFoundError:
            raise StoreError(f"no classgrad store at {url} ({loc.why_absent()})") from None
        except Exception as exc:
            raise StoreError(f"cannot open store at {url}: {_one_line(exc)}") from None
        meta = self._group.attrs.get(_ATTR_KEY)
        if not isinstance(meta, dict):
            raise StoreError(f"{url} is a Zarr group but not a classgrad store "
                             f"(no '{_ATTR_KEY}' attributes)")
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise StoreError(f"store at {url} has format version {version}; this classgrad "
                             f"reads version {FORMAT_VERSION}")
        if meta.get("state") != "ready":
            raise StoreError(f"store at {url} was not fully created (interrupted); rerun the "
                             f"job to recreate it")
        self._meta = meta
        self._arrays: dict[str, zarr.Array] = {}
        for name in _ARRAYS:
            try:
                arr = self._group[name]
            except KeyError:
                raise StoreError(f"store at {url} has no '{name}' array; it is damaged") from None
            # Every chunk is written, even one equal to the fill value, so a written chunk
            # is never confused with a missing one (and no fill-value scan is paid per chunk).
            self._arrays[name] = arr.with_config({"write_empty_chunks": True})
        try:
            self._spec = _spec_from_meta(meta)
        except (KeyError, TypeError, StoreError) as exc:
            raise StoreError(f"store at {url} has damaged classgrad attributes: "
                             f"{_one_line(exc)}") from None
        self._layout = {e.name: e for e in self._spec.layout}
        ids = self._spec.class_ids
        self._class_ids = np.arange(self.num_classes, dtype=np.int64) if ids is None else \
            np.asarray(ids, dtype=np.int64)
        self._class_ids.flags.writeable = False
        # Rows of local, uncompressed, unsharded stores are written by _write_direct.
        self._direct = loc.local and self._spec.codec == "none" and not self._spec.sharded

    def __repr__(self) -> str:
        return (f"GradStore({self.url!r}, {self.num_classes} x {self.dim} {self.dtype}, "
                f"mode={self._mode!r})")

    # ----------------------------------------------------------------- metadata

    @property
    def url(self) -> str:
        return self._loc.url

    @property
    def local_path(self) -> str | None:
        """The store's directory (absolute, ``~`` expanded) when it is local, else None."""
        return self._loc.path if self._loc.local else None

    @property
    def spec(self) -> StoreSpec:
        return self._spec

    @property
    def num_classes(self) -> int:
        return self._spec.num_classes

    @property
    def dim(self) -> int:
        return self._spec.dim

    @property
    def dtype(self) -> str:
        return self._spec.dtype

    @property
    def row_chunk(self) -> int:
        return self._spec.row_chunk

    @property
    def col_chunk(self) -> int:
        return self._spec.col_chunk

    @property
    def shard_rows(self) -> int:
        return self._spec.shard_rows

    @property
    def num_shards(self) -> int:
        return self._spec.num_shards

    @property
    def write_align(self) -> int:
        """Rows a write must start at a multiple of (and cover): the unit stored as one object."""
        return self._spec.shard_rows if self._spec.sharded else self._spec.row_chunk

    @property
    def layout(self) -> tuple[ParamEntry, ...]:
        return self._spec.layout

    @property
    def class_ids(self) -> np.ndarray:
        """Class of each row (int64, read-only)."""
        return self._class_ids

    @property
    def class_names(self) -> list[str] | None:
        names = self._spec.class_names
        return None if names is None else list(names)

    @property
    def fingerprint(self) -> str:
        return self._spec.fingerprint

    @property
    def attrs(self) -> dict:
        return copy.deepcopy(self._meta)

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Rows [start, stop) of a work shard; the last one may be short."""
        if not 0 <= shard < self.num_shards:
            raise StoreError(f"shard {shard} out of range [0, {self.num_shards})")
        start = shard * self.shard_rows
        return start, min(start + self.shard_rows, self.num_classes)

    # ----------------------------------------------------------------- writing

    def _require_writable(self) -> None:
        if self._mode == "r":
            raise StoreError(f"store {self.url} is open read-only; open it with mode='r+'")

    def write_rows(self, start: int, rows: np.ndarray, *, loss: np.ndarray,
                   count: np.ndarray) -> int:
        """Store rows [start, start + n): true float32 values, plus per-row loss and count.

        ``start`` must be a multiple of ``write_align`` and ``n`` too, unless the rows end at
        the last row, so every chunk is written whole, by one writer. Non-finite rows are
        refused. Returns the bytes handed to the store (before compression).
        """
        self._require_writable()
        rows = np.asarray(rows)
        C, D = self.num_classes, self.dim
        if rows.ndim != 2 or rows.shape[1] != D:
            raise StoreError(f"write_rows: rows must have shape [n, {D}], got {list(rows.shape)}")
        start = int(start)
        n = rows.shape[0]
        stop = start + n
        if n == 0 or start < 0 or stop > C:
            raise StoreError(f"write_rows: rows [{start}, {stop}) are empty or outside [0, {C})")
        align = self.write_align
        if start % align or (n % align and stop != C):
            raise StoreError(
                f"misaligned write: rows [{start}, {stop}) of {self.url} must start at a "
                f"multiple of {align} and cover whole chunks of {align} rows (or end at row {C})")
        loss = np.asarray(loss, dtype=np.float32)
        count = np.asarray(count)
        if loss.shape != (n,) or count.shape != (n,):
            raise StoreError(f"write_rows: loss and count must have shape [{n}], got "
                             f"{list(loss.shape)} and {list(count.shape)}")
        count = count.astype(np.int64, copy=False)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if self.dtype == "float32":
            # One pass: a row sum is finite only if every value in the row is.
            maxabs = None
            with np.errstate(over="ignore", invalid="ignore"):
                sums = rows.sum(axis=1)
            bad = np.flatnonzero(~np.isfinite(sums))
            bad = bad[~np.isfinite(rows[bad]).all(axis=1)]  # a finite row may sum to inf
        else:
            maxabs = _row_maxabs(rows)
            bad = np.flatnonzero(~np.isfinite(maxabs))
        if bad.size:
            row = start + int(bad[0])
            raise StoreError(f"write_rows: row {row} (class {int(self.class_ids[row])}) has "
                             f"non-finite values; refusing to store it")
        stored, scale = _encode_rows(rows, maxabs, self.dtype)
        try:
            for name, values in (("grads", stored), ("row_scale", scale), ("loss", loss),
                                 ("count", count)):
                if self._direct:
                    self._write_direct(name, start, values)
                else:
                    self._arrays[name][start:stop] = values
        except Exception as exc:
            raise StoreError(f"cannot write rows [{start}, {stop}) to {self.url}: "
                             f"{_one_line(exc)}") from None
        return stored.nbytes + scale.nbytes + loss.nbytes + count.nbytes

    def _write_direct(self, name: str, start: int, values: np.ndarray) -> None:
        """Write the chunks of ``name`` covering rows [start, start + len(values)) straight to
        files, in the Zarr v3 chunk format this store declares: the chunk's little-endian
        bytes, then their crc32c as a little-endian uint32, at key <name>/c/<i>[/<j>]; each
        through a temporary file and a rename, as Zarr's LocalStore does. zarr-python's
        pipeline copies every chunk three times (fill, merge, checksum append), which halves
        write throughput; a test checks these files are byte-identical to Zarr's own."""
        arr = self._arrays[name]
        chunks = arr.chunks
        little = values.dtype.newbyteorder("<")
        root = os.path.join(self._loc.path, name, "c")
        rc = chunks[0]
        for r0 in range(0, values.shape[0], rc):
            rows = values[r0: r0 + rc]
            ri = (start + r0) // rc
            if values.ndim == 1:
                parts = [(root, str(ri), rows)]
            else:
                cc = chunks[1]
                row_dir = os.path.join(root, str(ri))
                parts = [(row_dir, str(c0 // cc), rows[:, c0: c0 + cc])
                         for c0 in range(0, values.shape[1], cc)]
            os.makedirs(parts[0][0], exist_ok=True)
            for directory, leaf, block in parts:
                if block.shape != chunks:
                    # Zarr stores edge chunks full size, padded with the fill value.
                    full = np.full(chunks, arr.fill_value, dtype=little)
                    full[tuple(slice(0, n) for n in block.shape)] = block
                    block = full
                data = memoryview(np.ascontiguousarray(block, dtype=little)).cast("B")
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

    def _set_done(self, shard: int, value: int) -> None:
        self._require_writable()
        self.shard_range(shard)  # range check
        try:
            self._arrays["shard_done"][shard] = value
        except Exception as exc:
            raise StoreError(f"cannot update shard_done[{shard}] in {self.url}: "
                             f"{_one_line(exc)}") from None

    def mark_shard_done(self, shard: int) -> None:
        """Mark a shard complete; call only once all its rows have been written."""
        self._set_done(shard, 1)

    def clear_shard_done(self, shard: int) -> None:
        self._set_done(shard, 0)

    # ----------------------------------------------------------------- completeness

    @property
    def shard_done(self) -> np.ndarray:
        return self._read_all("shard_done").astype(bool)

    @property
    def is_complete(self) -> bool:
        return bool(self.shard_done.all())

    def missing_ranges(self, done: np.ndarray | None = None) -> list[tuple[int, int]]:
        """Merged [start, stop) row ranges of shards not marked done. Pass ``done`` when the
        caller has already read ``shard_done`` (each read is one request per shard on S3)."""
        done = self.shard_done if done is None else np.asarray(done, dtype=bool)
        s = self.shard_rows
        return [(a * s, min(b * s, self.num_classes)) for a, b in _ranges(np.flatnonzero(~done))]

    # ----------------------------------------------------------------- reading

    def _row_ids(self, ids: Any) -> np.ndarray:
        C = self.num_classes
        if ids is None:
            return np.arange(C, dtype=np.int64)
        if isinstance(ids, slice):
            return np.arange(*ids.indices(C), dtype=np.int64)
        arr = np.asarray(ids).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise StoreError(f"row ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= C):
            raise StoreError(f"row ids must lie in [0, {C}), got [{arr.min()}, {arr.max()}]")
        return arr

    def _read(self, name: str, rows: np.ndarray,
              cols: slice | np.ndarray | None = None) -> np.ndarray:
        """Values of ``name`` at sorted unique ``rows`` (and ``cols``, a slice or sorted unique
        indices, for 2-D arrays; default all)."""
        arr = self._arrays[name]
        contiguous = rows.size > 0 and rows[-1] - rows[0] + 1 == rows.size
        sel_rows = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows
        selection = (sel_rows,) if arr.ndim == 1 else \
            (sel_rows, slice(None) if cols is None else cols)
        try:
            return arr.get_orthogonal_selection(selection)
        except ClassgradError:
            raise
        except Exception as exc:
            # Index columns: every column chunk of the rows is checked.
            raise self._read_error(name, rows, cols if isinstance(cols, slice) else None,
                                   exc) from None

    def _read_all(self, name: str) -> np.ndarray:
        return self._read(name, np.arange(self._arrays[name].shape[0], dtype=np.int64))

    def _chunk_key(self, name: str, index: tuple[int, ...]) -> str:
        arr = self._arrays[name]
        if arr.shards is None:
            return f"{name}/c/" + "/".join(map(str, index))
        per = [s // c for s, c in zip(arr.shards, arr.chunks)]
        outer = [i // p for i, p in zip(index, per)]
        return f"{name}/c/" + "/".join(map(str, outer)) + f" (inner chunk {tuple(index)})"

    def _chunk_slices(self, name: str, index: tuple[int, ...]) -> tuple[slice, ...]:
        arr = self._arrays[name]
        return tuple(slice(i * c, min((i + 1) * c, s))
                     for i, c, s in zip(index, arr.chunks, arr.shape))

    def _corrupt_chunks(self, name: str, indices: list[tuple[int, ...]]) -> list[tuple[tuple, str]]:
        """Read chunks one by one; return (index, reason) of each one that fails to decode."""
        arr = self._arrays[name]
        bad = []
        for index in indices:
            try:
                arr[self._chunk_slices(name, index)]
            except Exception as exc:
                if _is_corruption(exc):
                    reason = ("crc32c checksum mismatch" if "checksum" in str(exc)
                              else _one_line(exc))
                    bad.append((index, reason))
        return bad

    def _describe_chunk(self, name: str, index: tuple[int, ...], reason: str) -> str:
        rows = self._chunk_slices(name, index)[0]
        return (f"{name} chunk {tuple(index)} (key {self._chunk_key(name, index)}, rows "
                f"[{rows.start}, {rows.stop})): {reason}")

    def _read_error(self, name: str, rows: np.ndarray, cols: slice | None,
                    exc: Exception) -> StoreError:
        """The error to raise for a failed read: CorruptChunkError naming the first chunk that
        fails on its own, else a StoreError carrying the I/O problem."""
        arr = self._arrays[name]
        row_idx = np.unique(rows // arr.chunks[0])
        if arr.ndim == 1:
            indices = [(int(i),) for i in row_idx]
        else:
            cols = cols or slice(0, arr.shape[1])
            col_idx = range(cols.start // arr.chunks[1], -(-cols.stop // arr.chunks[1]))
            indices = [(int(i), j) for i in row_idx for j in col_idx]
        bad = self._corrupt_chunks(name, indices) if _is_corruption(exc) else []
        if bad:
            index, reason = bad[0]
            more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
            return CorruptChunkError(
                f"corrupt data in store {self.url}: {self._describe_chunk(name, index, reason)}"
                f"{more}; recompute those rows (`classgrad verify` lists every bad chunk)")
        return StoreError(f"cannot read {name} from {self.url}: {_one_line(exc)}")

    def _present(self, uniq: np.ndarray, allow_missing: bool) -> np.ndarray:
        """Which of the sorted unique rows belong to done shards; raises unless allow_missing."""
        shards = uniq // self.shard_rows
        done_shards = np.unique(shards)
        done = self._read("shard_done", done_shards).astype(bool)
        present = done[np.searchsorted(done_shards, shards)]
        if not allow_missing and not present.all():
            raise StoreIncompleteError(
                f"rows {fmt_ranges(_ranges(uniq[~present]))} of store {self.url} are not "
                f"written yet (their shards are not marked done); rerun the job to finish them, "
                f"or pass allow_missing=True to get NaN rows")
        return present

    def _gather(self, ids: np.ndarray, cols: slice, allow_missing: bool) -> np.ndarray:
        """True float32 values of rows ``ids`` (any order, repeats allowed), columns ``cols``."""
        uniq, inverse = np.unique(ids, return_inverse=True)
        present = self._present(uniq, allow_missing)
        have = uniq[present]
        width = cols.stop - cols.start
        if have.size:
            scale = self._read("row_scale", have) if self.dtype != "float32" else None
            values = _decode_rows(self._read("grads", have, cols), scale, self.dtype)
            holes = np.isnan(values).any(axis=1)
            if holes.any():
                raise CorruptChunkError(
                    f"rows {fmt_ranges(_ranges(have[holes]))} of store {self.url} belong to "
                    f"shards marked done but read as never written (chunk objects missing); "
                    f"run `classgrad verify` and recompute those shards")
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

    def rows(self, ids: Any, *, allow_missing: bool = False) -> np.ndarray:
        """True float32 rows [len(ids), dim] at row indices ``ids`` (row i is class class_ids[i]).

        Rows of shards not marked done raise ``StoreIncompleteError`` naming them, unless
        ``allow_missing`` (then they come back as NaN).
        """
        return self._gather(self._row_ids(ids), slice(0, self.dim), allow_missing)

    def param(self, name: str, ids: Any, *, allow_missing: bool = False) -> np.ndarray:
        """One parameter's part of rows ``ids``, shaped [len(ids), *shape of the parameter]."""
        entry = self._layout.get(name)
        if entry is None:
            if not self._layout:
                raise StoreError(f"store {self.url} holds projected rows ({self.dim} dims); it "
                                 f"has no per-parameter layout")
            raise StoreError(f"unknown parameter {name!r}; the store holds: "
                             f"{', '.join(self._layout)}")
        ids = self._row_ids(ids)
        cols = slice(entry.offset, entry.offset + entry.size)
        return self._gather(ids, cols, allow_missing).reshape((ids.size, *entry.shape))

    def iter_blocks(self, rows_per_block: int, *,
                    allow_missing: bool = False) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (start, true float32 rows) in row order; blocks are whole row-chunks when
        ``rows_per_block >= row_chunk``. Incompleteness is reported before the first block."""
        if rows_per_block < 1:
            raise StoreError(f"rows_per_block must be positive, got {rows_per_block}")
        step = rows_per_block
        if step >= self.row_chunk:
            step -= step % self.row_chunk
        if not allow_missing:
            missing = self.missing_ranges()
            if missing:
                raise StoreIncompleteError(
                    f"rows {fmt_ranges(missing)} of store {self.url} are not written yet; "
                    f"rerun the job to finish them, or pass allow_missing=True for NaN rows")
        for start in range(0, self.num_classes, step):
            stop = min(start + step, self.num_classes)
            yield start, self._gather(np.arange(start, stop, dtype=np.int64),
                                      slice(0, self.dim), allow_missing)

    def _vector(self, name: str, ids: Any) -> np.ndarray:
        ids = self._row_ids(ids)
        uniq, inverse = np.unique(ids, return_inverse=True)
        if uniq.size == 0:
            return np.empty(0, dtype=self._arrays[name].dtype)
        return self._read(name, uniq)[inverse.reshape(-1)]

    def loss(self, ids: Any = None) -> np.ndarray:
        """Per-row loss (NaN where never written)."""
        return self._vector("loss", ids)

    def count(self, ids: Any = None) -> np.ndarray:
        """Per-row probe-sample count (-1 where never written)."""
        return self._vector("count", ids)

    def row_scale(self, ids: Any = None) -> np.ndarray:
        """Per-row scale: true row = stored row * row_scale (NaN where never written)."""
        return self._vector("row_scale", ids)

    def to_dask(self):
        """Lazy dask array [C, D] of true float32 values. Rows of shards not done (at the time
        of this call) are NaN; a corrupt chunk raises zarr's checksum ValueError on compute."""
        try:
            import dask.array as da
        except ImportError:
            raise StoreError("to_dask needs dask: pip install 'classgrad[read]'") from None
        grads = self._arrays["grads"]
        unit = grads.shards or grads.chunks
        x = da.from_zarr(grads, chunks=unit)
        if self.dtype != "float32":
            scale = da.from_zarr(self._arrays["row_scale"], chunks=(unit[0],))
            if self.dtype == "bfloat16":
                x = x.map_blocks(_bf16_bits_to_f32, dtype=np.float32)
            else:
                x = x.astype(np.float32)
            x = x * scale[:, None]
        done = np.repeat(self.shard_done, self.shard_rows)[: self.num_classes]
        if not done.all():
            x = da.where(da.from_array(done, chunks=(unit[0],))[:, None], x, np.float32(np.nan))
        return x

    # ----------------------------------------------------------------- verification

    def verify_chunks(self) -> list[str]:
        """Read every chunk of every array; return one line per problem (empty when sound):
        the messages of ``scan_chunks`` (corrupt or unreadable chunks, chunks missing from
        shards marked done, non-finite or invalid values, shard_done values other than 0/1)."""
        return [p.message for p in self.scan_chunks()]

    # ----------------------------------------------------------------- run history

    def append_run(self, entry: dict) -> None:
        """Append one run record (any JSON-serialisable dict) to attributes["runs"]."""
        self._require_writable()
        entry = json.loads(json.dumps(entry, default=str))
        try:
            group = zarr.open_group(self._loc.zarr_store(read_only=False), mode="r+",
                                    zarr_format=3)
            meta = group.attrs[_ATTR_KEY]
            meta.setdefault("runs", []).append(entry)
            group.update_attributes({_ATTR_KEY: meta})
        except Exception as exc:
            raise StoreError(f"cannot record the run in {self.url}: {_one_line(exc)}") from None
        self._meta = meta

    # ----------------------------------------------------------------- lease

    def _write_lease(self, lease: dict) -> None:
        try:
            self._loc.write_bytes(_LEASE_KEY, json.dumps(lease).encode())
        except OSError as exc:
            raise StoreError(f"cannot write the lease of {self.url}: {_one_line(exc)}") from None

    def acquire_lease(self, run_id: str, *, ttl_s: float = 60.0, info: dict | None = None) -> None:
        """Take the store for run ``run_id``: refused while another run's lease is fresh
        (heartbeat younger than the TTL its holder wrote into it, this run's ``ttl_s`` only for a
        lease without one); a stale one is taken over with a warning.

        Best effort (read, write, read back), not a distributed lock: it stops a second driver
        started by mistake, which is what it is for.
        """
        self._require_writable()
        now = time.time()
        current = _read_lease(self._loc)
        if current and current.get("run_id") != run_id:
            age = _lease_age(current, now)
            gone = _holder_gone(current)
            held_for = float(current.get("ttl_s", ttl_s))  # the holder's promise, not the newcomer's
            if age < held_for and not gone:
                raise LeaseHeldError(_held_message(self.url, current, now))
            why = "its driver process is gone" if gone else f"last heartbeat {age:.0f}s ago > {held_for:.0f}s"
            log.warning("taking over the stale lease of run %r on %s (host %s, pid %s): %s",
                        current.get("run_id"), self.url, current.get("host"), current.get("pid"), why)
        same_run = bool(current) and current.get("run_id") == run_id
        lease = {
            "run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
            "started": current["started"] if same_run else now, "heartbeat": now,
            "ttl_s": ttl_s, "info": json.loads(json.dumps(info or {}, default=str)),
        }
        self._write_lease(lease)
        back = _read_lease(self._loc)
        if not back or back.get("run_id") != run_id:  # another driver wrote in between
            raise LeaseHeldError(_held_message(self.url, back or {}, time.time()))

    def lease_info(self) -> dict | None:
        """The current lease (run_id, host, pid, started, heartbeat, ttl_s, info), or None."""
        return _read_lease(self._loc)

    def renew_lease(self, run_id: str) -> None:
        """Refresh the heartbeat; ``LeaseHeldError`` if another run has taken the lease."""
        self._require_writable()
        current = _read_lease(self._loc)
        if not current or current.get("run_id") != run_id:
            taker = f"run {current.get('run_id')!r}" if current else "nobody (it was released)"
            raise LeaseHeldError(f"run {run_id!r} lost its lease on {self.url}: now held by "
                                 f"{taker}")
        current["heartbeat"] = time.time()
        self._write_lease(current)

    def release_lease(self, run_id: str) -> None:
        """Drop the lease if ``run_id`` holds it (another run's lease is left alone)."""
        self._require_writable()
        current = _read_lease(self._loc)
        if current is None:
            return
        if current.get("run_id") != run_id:
            log.warning("not releasing the lease on %s: it is held by run %r, not %r", self.url,
                        current.get("run_id"), run_id)
            return
        try:
            self._loc.delete(_LEASE_KEY)
        except OSError as exc:
            raise StoreError(f"cannot release the lease of {self.url}: {_one_line(exc)}") from None

    # ================================================================== downstream results
    # Everything from this line to the end of the module serves the downstream jobs
    # (``classgrad similarity | inspect | verify | plot | aggregate``, ``service/analysis``):
    # a block reader with a column range, the arrays those jobs write (the class similarity
    # matrix and its top-k neighbour table) and the structured checks behind ``classgrad
    # verify``. It is additive: above this line only ``verify_chunks`` uses it (it reports
    # ``scan_chunks``' messages).

    def block(self, start: int, stop: int, cols: slice | tuple[int, int] | None = None, *,
              allow_missing: bool = False) -> np.ndarray:
        """True float32 values of rows [start, stop) and columns ``cols`` (a slice or a
        (start, stop) pair; default every column): the unit out-of-core jobs read."""
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_classes:
            raise StoreError(f"block: rows [{start}, {stop}) are outside [0, {self.num_classes})")
        cols = _col_range(cols, self.dim)
        if start == stop:
            return np.empty((0, cols.stop - cols.start), dtype=np.float32)
        return self._gather(np.arange(start, stop, dtype=np.int64), cols, allow_missing)

    def rows_band(self, ids: Any, cols: slice | tuple[int, int], *,
                  allow_missing: bool = False) -> np.ndarray:
        """True float32 values of rows ``ids`` (any order, repeats allowed) in one column range:
        ``rows`` for a few scattered rows whose full length would not fit in memory."""
        return self._gather(self._row_ids(ids), _col_range(cols, self.dim), allow_missing)

    def _result(self, name: str) -> zarr.Array | None:
        """A result array, freshly opened (another process may have replaced it), or None."""
        try:
            node = self._group[name]
        except KeyError:
            self._arrays.pop(name, None)
            return None
        except Exception as exc:
            raise StoreError(f"cannot open {name} in {self.url}: {_one_line(exc)}") from None
        if not isinstance(node, zarr.Array):
            raise StoreError(f"store {self.url}: '{name}' is not an array; it is damaged")
        arr = node.with_config({"write_empty_chunks": True})
        self._arrays[name] = arr  # lets the chunk helpers above describe its chunks
        return arr

    def similarity_info(self) -> dict | None:
        """Attributes of the stored similarity matrix (``metric``, ``state`` "computing" or
        "ready", ``top_k``, ``chunk_rows``, ``source_fingerprint``, ``run_id``, timings...),
        or None when ``classgrad similarity`` has not been run on this store."""
        arr = self._result(_SIM)
        return None if arr is None else dict(arr.attrs)

    def begin_similarity(self, *, metric: str, top_k: int, chunk_rows: int, run_id: str,
                         info: dict | None = None) -> None:
        """Driver of ``classgrad similarity`` only: replace any previous result by empty
        arrays marked ``state: "computing"`` until ``finish_similarity``. The old matrix is
        deleted first, so a rerun never mixes two runs' rows, and a run that dies part-way
        leaves a result that readers refuse instead of trust."""
        self._require_writable()
        C = self.num_classes
        if metric not in SIMILARITY_METRICS:
            raise StoreError(f"similarity metric must be one of {', '.join(SIMILARITY_METRICS)}, "
                             f"got {metric!r}")
        if not 0 <= int(top_k) <= max(C - 1, 0):
            raise StoreError(f"top_k must lie in [0, {C - 1}] (self is excluded), got {top_k}")
        if not 1 <= int(chunk_rows) <= C:
            raise StoreError(f"similarity chunk_rows must lie in [1, {C}], got {chunk_rows}")
        top_k, chunk_rows = int(top_k), int(chunk_rows)
        attrs = json.loads(json.dumps({
            "metric": metric, "state": "computing", "top_k": top_k, "chunk_rows": chunk_rows,
            "source_fingerprint": self.fingerprint, "run_id": run_id,
            "neighbours": "similarity_topk_index holds row indices (row i is class "
                          "class_ids[i]), most similar first, ties by lower index, self excluded",
            "started": time.time(), **(info or {}),
        }, default=str))
        arrays = [  # name, shape, chunks, dtype, fill, dimension names
            (_SIM_INDEX, (C, top_k), (chunk_rows, max(top_k, 1)), "int64", -1,
             ("class", "neighbour")),
            (_SIM_VALUE, (C, top_k), (chunk_rows, max(top_k, 1)), "float32", np.nan,
             ("class", "neighbour")),
            (_SIM, (C, C), (chunk_rows, C), "float32", np.nan, ("class", "other_class")),
        ]
        try:
            for name in _RESULT_ARRAYS:
                if name in self._group:
                    del self._group[name]  # the matrix first: it is what marks a result
                self._arrays.pop(name, None)
            for name, shape, chunks, dtype, fill, dims in arrays:
                if name != _SIM and top_k == 0:
                    continue
                self._group.create_array(
                    name, shape=shape, chunks=chunks, dtype=dtype, fill_value=fill,
                    serializer=BytesCodec(endian="little"), compressors=_codecs("none"),
                    dimension_names=dims, attributes=attrs if name == _SIM else {},
                )
        except ClassgradError:
            raise
        except Exception as exc:
            raise StoreError(f"cannot create the similarity arrays in {self.url}: "
                             f"{_one_line(exc)}") from None

    def _similarity_run(self, run_id: str) -> tuple[zarr.Array, dict]:
        arr = self._result(_SIM)
        info = None if arr is None else dict(arr.attrs)
        if info is None or info.get("run_id") != run_id or info.get("state") != "computing":
            now = "no similarity" if info is None else \
                f"run {info.get('run_id')!r} ({info.get('state')})"
            raise StoreError(f"similarity run {run_id!r} no longer owns {self.url}: it now holds "
                             f"{now}")
        return arr, info

    def write_similarity_rows(self, start: int, values: np.ndarray, *, run_id: str,
                              topk_index: np.ndarray | None = None,
                              topk_value: np.ndarray | None = None) -> None:
        """Store rows [start, start + n) of the similarity matrix (float32 [n, C]) and their
        top-k neighbours ([n, top_k] row indices and values), for run ``run_id``.

        ``start`` and ``n`` must cover whole chunks of ``chunk_rows`` rows (``n`` may end at the
        last row), so each chunk is written whole, by one writer; non-finite values are refused.
        """
        self._require_writable()
        arr, info = self._similarity_run(run_id)
        C, k, rc = self.num_classes, int(info["top_k"]), int(info["chunk_rows"])
        values = np.ascontiguousarray(values, dtype=np.float32)
        start = int(start)
        n = values.shape[0] if values.ndim == 2 else 0
        stop = start + n
        if values.ndim != 2 or values.shape[1] != C or n == 0 or start < 0 or stop > C:
            raise StoreError(f"write_similarity_rows: expected rows [n, {C}] inside [0, {C}), "
                             f"got shape {list(values.shape)} at row {start}")
        if start % rc or (n % rc and stop != C):
            raise StoreError(f"misaligned similarity write: rows [{start}, {stop}) must start at a "
                             f"multiple of {rc} and cover whole chunks of {rc} rows")
        if not np.isfinite(values).all():
            raise StoreError(f"write_similarity_rows: rows [{start}, {stop}) hold non-finite "
                             f"values; refusing to store them")
        parts: list[tuple[str, np.ndarray]] = [(_SIM, values)]
        if k:
            index = np.asarray(topk_index)
            value = np.asarray(topk_value, dtype=np.float32)
            if index.shape != (n, k) or value.shape != (n, k):
                raise StoreError(f"write_similarity_rows: top-k index and value must have shape "
                                 f"[{n}, {k}], got {list(index.shape)} and {list(value.shape)}")
            if index.size and (index.min() < 0 or index.max() >= C):
                raise StoreError("write_similarity_rows: top-k indices outside [0, C)")
            parts += [(_SIM_INDEX, index.astype(np.int64)), (_SIM_VALUE, value)]
        # A few whole chunks per call: zarr encodes the chunks of one call concurrently, each
        # in several copies, so one call for a whole strip would double its memory.
        step = max(1, _SIM_WRITE_BYTES // (rc * C * 4)) * rc
        try:
            for name, data in parts:
                target = arr if name == _SIM else self._result(name)
                for r0 in range(0, n, step):
                    target[start + r0: min(start + r0 + step, stop)] = data[r0: r0 + step]
        except ClassgradError:
            raise
        except Exception as exc:
            raise StoreError(f"cannot write similarity rows [{start}, {stop}) to {self.url}: "
                             f"{_one_line(exc)}") from None

    def finish_similarity(self, run_id: str, info: dict | None = None) -> None:
        """Mark run ``run_id``'s similarity complete (``state: "ready"``), adding ``info``."""
        self._require_writable()
        arr, attrs = self._similarity_run(run_id)
        attrs.update(json.loads(json.dumps(info or {}, default=str)))
        attrs.update(state="ready", finished=time.time())
        try:
            arr.update_attributes(attrs)
        except Exception as exc:
            raise StoreError(f"cannot finish the similarity of {self.url}: "
                             f"{_one_line(exc)}") from None

    def _ready_similarity(self) -> tuple[zarr.Array, dict]:
        arr = self._result(_SIM)
        if arr is None:
            raise StoreError(f"store {self.url} has no similarity matrix; run `classgrad "
                             f"similarity {self.url}` first")
        info = dict(arr.attrs)
        if info.get("state") != "ready":
            raise StoreError(f"the similarity matrix of {self.url} is unfinished (run "
                             f"{info.get('run_id')!r} did not complete); rerun `classgrad "
                             f"similarity`")
        if info.get("source_fingerprint") != self.fingerprint:
            raise StoreError(f"the similarity matrix of {self.url} was computed from other rows "
                             f"(fingerprint {info.get('source_fingerprint')!r}, the store's "
                             f"{self.fingerprint!r}); rerun `classgrad similarity`")
        return arr, info

    def _read_result(self, arr: zarr.Array, name: str, ids: np.ndarray,
                     cols: np.ndarray | None) -> np.ndarray:
        uniq, inverse = np.unique(ids, return_inverse=True)
        ucols, col_inverse = (None, None) if cols is None else \
            np.unique(cols, return_inverse=True)
        if uniq.size == 0:
            width = arr.shape[1] if cols is None else cols.size
            return np.empty((0, width), dtype=arr.dtype)
        out = self._read(name, uniq, ucols)[inverse.reshape(-1)]
        return out if col_inverse is None else out[:, col_inverse.reshape(-1)]

    def similarity(self, ids: Any = None, cols: Any = None) -> np.ndarray:
        """Rows ``ids`` (default all) and columns ``cols`` (default all) of the stored class
        similarity matrix, float32; refused unless a finished result of these rows exists."""
        arr, _ = self._ready_similarity()
        ids = self._row_ids(ids)
        cols = None if cols is None else self._row_ids(cols)
        return self._read_result(arr, _SIM, ids, cols)

    def similarity_neighbours(self, ids: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k neighbours of rows ``ids`` (default all): (row indices int64 [n, k], values
        float32 [n, k]), most similar first, self excluded; row i is class ``class_ids[i]``."""
        _, info = self._ready_similarity()
        if not info.get("top_k"):
            raise StoreError(f"the similarity of {self.url} was computed with top_k 0; rerun "
                             f"`classgrad similarity --top-k K`")
        ids = self._row_ids(ids)
        index = self._read_result(self._result(_SIM_INDEX), _SIM_INDEX, ids, None)
        value = self._read_result(self._result(_SIM_VALUE), _SIM_VALUE, ids, None)
        return index, value

    # ----------------------------------------------------------------- structured checks

    def _chunk_exists(self, name: str, index: tuple[int, ...]) -> bool:
        key = self._chunk_key(name, index).split(" ", 1)[0]  # sharded: the shard object
        try:
            return bool(self._loc.fs.exists(self._loc.key(key)))
        except OSError:
            return True  # cannot tell: do not call it missing

    def scan_chunks(self) -> list[ChunkProblem]:
        """Read every chunk of every array once (results included) and report each problem
        with its kind, for ``classgrad verify``:

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
        is reported as ``nonfinite``).
        """
        problems: list[ChunkProblem] = []
        try:
            done = self.shard_done
        except CorruptChunkError as exc:
            return [ChunkProblem("shard_done", "corrupt", str(exc))]
        done_rows = np.repeat(done, self.shard_rows)[: self.num_classes]
        names: list[tuple[str, np.ndarray | None]] = [
            (n, None if n == "shard_done" else done_rows) for n in _ARRAYS]
        info = self.similarity_info()
        if info is not None:
            ready = np.full(self.num_classes, info.get("state") == "ready")
            names += [(n, ready) for n in _RESULT_ARRAYS if self._result(n) is not None]
        for name, checked in names:
            arr = self._arrays[name]
            for sel, indices, block, exc in self._scan_blocks(arr):
                if exc is not None:
                    bad = self._corrupt_chunks(name, indices) if _is_corruption(exc) else []
                    problems += [ChunkProblem(name, "corrupt", self._describe_chunk(name, i, why))
                                 for i, why in bad]
                    if not bad:
                        problems.append(ChunkProblem(
                            name, "unreadable", f"{name} rows [{sel[0].start}, {sel[0].stop}): "
                                                f"cannot read: {_one_line(exc)}"))
                    continue
                problems += self._scan_values(name, block, sel, checked)
        return problems

    def _scan_blocks(self, arr: zarr.Array) -> Iterator[tuple[tuple[slice, ...], list, Any, Any]]:
        """(selection, chunk indices, values or None, exception or None) over an array, in
        reads of at most _SCAN_ELEMS elements made of whole chunks."""
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
                indices = [(ri,) for ri in ris] if cols is None else [
                    (ri, cj) for ri in ris
                    for cj in range(cols.start // arr.chunks[1], -(-cols.stop // arr.chunks[1]))]
                try:
                    block, error = arr[sel], None
                except Exception as exc:  # noqa: BLE001 - classified by the caller
                    block, error = None, exc
                yield sel, indices, block, error

    def _scan_values(self, name: str, block: np.ndarray, sel: tuple[slice, ...],
                     checked: np.ndarray | None) -> list[ChunkProblem]:
        """Problems in the values of one read block (rows ``sel[0]``, columns ``sel[1]``)."""
        rows = sel[0]
        if name == "shard_done":
            return [ChunkProblem(name, "bad_value", f"shard_done[{rows.start + s}] = {block[s]} "
                                                    f"(expected 0 or 1)")
                    for s in np.flatnonzero(block > 1)]
        mask = checked[rows]
        if not mask.any():
            return []
        if name == "grads" and self.dtype == "bfloat16":
            bad = (block & np.uint16(0x7F80)) == np.uint16(0x7F80)  # exponent all ones
        elif name in ("count", _SIM_INDEX):
            bad = (block < 0) | (block >= self.num_classes) if name == _SIM_INDEX else block < 0
        elif name == "row_scale":
            with np.errstate(invalid="ignore"):
                bad = ~(np.isfinite(block) & (block > 0))
        else:
            bad = ~np.isfinite(block)
        bad &= mask.reshape((-1,) + (1,) * (bad.ndim - 1))
        if not bad.any():
            return []
        arr = self._arrays[name]
        rc = arr.chunks[0]
        out = []
        bad_rows = bad if bad.ndim == 1 else bad.any(axis=1)
        for ri in np.unique((rows.start + np.flatnonzero(bad_rows)) // rc):
            local = slice(ri * rc - rows.start, min((ri + 1) * rc, rows.stop) - rows.start)
            if bad.ndim == 1:
                parts = [((int(ri),), bad[local])]
            else:
                c0, cc = sel[1].start, arr.chunks[1]
                parts = [((int(ri), cj), bad[local, cj * cc - c0: (cj + 1) * cc - c0])
                         for cj in range(c0 // cc, -(-sel[1].stop // cc))]
            for index, part in parts:
                if not part.any():
                    continue
                which = rows.start + local.start + np.flatnonzero(
                    part if part.ndim == 1 else part.any(axis=1))
                where = f"rows {fmt_ranges(_ranges(which))}"
                if not self._chunk_exists(name, index):
                    kind, why = "missing", "missing although its rows are marked done"
                elif name in ("row_scale", "count", _SIM_INDEX):
                    kind, why = "bad_value", f"{where}: invalid values ({name})"
                else:
                    kind, why = "nonfinite", f"{where}: {int(part.sum())} NaN/Inf values"
                out.append(ChunkProblem(name, kind, self._describe_chunk(name, index, why)))
        return out


# --------------------------------------------------------------------------- downstream results
# (module level; see the section at the end of GradStore)

SIMILARITY_METRICS = ("cosine", "dot")
_SIM = "similarity"
_SIM_INDEX = "similarity_topk_index"
_SIM_VALUE = "similarity_topk_value"
_RESULT_ARRAYS = (_SIM, _SIM_INDEX, _SIM_VALUE)  # the matrix first: deleted first on a rerun
# write_similarity_rows hands zarr about this many bytes per call (whole chunks).
_SIM_WRITE_BYTES = 8 << 20
# scan_chunks reads this many elements per request at most (64 MiB of float32).
_SCAN_ELEMS = 1 << 24


@dataclass(frozen=True)
class ChunkProblem:
    """One problem found by ``GradStore.scan_chunks``: the array, a kind (corrupt,
    unreadable, missing, nonfinite, bad_value) and a one-line message naming the chunk."""

    array: str
    kind: str
    message: str


def _col_range(cols: slice | tuple[int, int] | None, dim: int) -> slice:
    if cols is None:
        return slice(0, dim)
    if isinstance(cols, slice):
        if cols.step not in (None, 1):
            raise StoreError(f"column range must be contiguous, got step {cols.step}")
        start, stop, _ = cols.indices(dim)
    else:
        start, stop = (int(c) for c in cols)
    if not 0 <= start <= stop <= dim:
        raise StoreError(f"columns [{start}, {stop}) are outside [0, {dim})")
    return slice(start, stop)


def check_metadata(url: str, *, storage_options: dict | None = None) -> list[str]:
    """Check a store's metadata without trusting it (``classgrad verify``): one line per
    problem, empty when consistent. Checks the format version and state; the sizes (number of
    shards, chunk alignment); dtype; the parameter layout (offsets contiguous from 0, sizes
    matching shapes, summing to dim, unique names; empty when projected); class ids and names
    (one per row, ids unique); a non-empty fingerprint; every array's shape, dtype and chunks;
    and, if present, the similarity's shape, metric and source fingerprint. Raises
    ``StoreError`` when there is no classgrad store at ``url`` at all."""
    loc = _Location(url, storage_options)
    state, meta = _probe(loc)
    if state == "empty":
        raise StoreError(f"no classgrad store at {url} ({loc.why_absent()})")
    if state == "other":
        raise StoreError(f"{url} holds something that is not a classgrad store")
    problems: list[str] = []
    if meta.get("format_version") != FORMAT_VERSION:
        problems.append(f"format_version is {meta.get('format_version')!r}, expected "
                        f"{FORMAT_VERSION}")
    if meta.get("state") != "ready":
        problems.append(f"state is {meta.get('state')!r}: creation was interrupted")
    ints = ("num_classes", "dim", "shard_rows", "num_shards", "row_chunk", "col_chunk")
    for key in ints:
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key} is {value!r}, expected a positive integer")
    if problems:
        return problems
    C, D = meta["num_classes"], meta["dim"]
    if meta["num_shards"] != -(-C // meta["shard_rows"]):
        problems.append(f"num_shards is {meta['num_shards']}, but {C} classes in shards of "
                        f"{meta['shard_rows']} make {-(-C // meta['shard_rows'])}")
    if meta["shard_rows"] % meta["row_chunk"]:
        problems.append(f"shard_rows ({meta['shard_rows']}) is not a multiple of row_chunk "
                        f"({meta['row_chunk']})")
    dtype = meta.get("dtype")
    if dtype not in _STORAGE_DTYPES:
        problems.append(f"dtype is {dtype!r}, expected one of {', '.join(_STORAGE_DTYPES)}")
    elif meta.get("storage_dtype") != _STORAGE_DTYPES[dtype]:
        problems.append(f"storage_dtype is {meta.get('storage_dtype')!r}, expected "
                        f"{_STORAGE_DTYPES[dtype]!r} for dtype {dtype}")
    problems += _check_layout(meta.get("layout"), meta.get("projection"), D)
    ids, names = meta.get("class_ids"), meta.get("class_names")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) != C:
            problems.append(f"class_ids has {len(ids) if isinstance(ids, list) else ids!r} "
                            f"entries, expected one per row ({C})")
        elif not all(isinstance(i, int) for i in ids) or len(set(ids)) != C:
            problems.append("class_ids are not distinct integers")
    if names is not None and (not isinstance(names, list) or len(names) != C):
        problems.append(f"class_names has {len(names) if isinstance(names, list) else names!r} "
                        f"entries, expected one per row ({C})")
    fingerprint = meta.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        problems.append(f"fingerprint is {fingerprint!r}: missing (a rerun could not tell "
                        f"whether the store was made by its config)")
    problems += _check_arrays(loc, meta)
    return problems


def _check_layout(layout: Any, projection: Any, dim: int) -> list[str]:
    if projection is not None:
        out = [] if isinstance(projection, dict) else [f"projection is {projection!r}, "
                                                       f"expected a mapping"]
        if layout:
            out.append("layout is not empty although the rows are projected")
        out_dim = projection.get("out_dim") if isinstance(projection, dict) else None
        if out_dim is not None and out_dim != dim:
            out.append(f"projection out_dim ({out_dim}) differs from dim ({dim})")
        return out
    if not isinstance(layout, list):
        return [f"layout is {layout!r}, expected a list"]
    if not layout:
        return []
    out, expected, seen = [], 0, set()
    for i, entry in enumerate(layout):
        try:
            name, shape = str(entry["name"]), [int(s) for s in entry["shape"]]
            offset, size = int(entry["offset"]), int(entry["size"])
        except (KeyError, TypeError, ValueError):
            return out + [f"layout entry {i} is malformed: {entry!r}"]
        if offset != expected:
            out.append(f"layout entry {name!r} starts at {offset}, expected {expected} (entries "
                       f"must be contiguous, in row order)")
        if size != math.prod(shape):
            out.append(f"layout entry {name!r} has size {size} but shape {shape}")
        if name in seen:
            out.append(f"layout names {name!r} twice")
        seen.add(name)
        expected = offset + size
    if expected != dim:
        out.append(f"layout sizes add up to {expected}, not dim ({dim})")
    return out


def _check_arrays(loc: _Location, meta: dict) -> list[str]:
    C, D = meta["num_classes"], meta["dim"]
    expected = _array_table(C, D, meta["row_chunk"], min(meta["col_chunk"], D),
                            meta["num_shards"], _STORAGE_DTYPES.get(meta.get("dtype"), "?"))
    out = []
    try:
        group = zarr.open_group(loc.zarr_store(read_only=True), mode="r", zarr_format=3)
    except Exception as exc:
        return [f"cannot open the group: {_one_line(exc)}"]
    for name, (shape, chunks, dtype) in expected.items():
        try:
            arr = group[name]
        except KeyError:
            out.append(f"array {name!r} is missing")
            continue
        if tuple(arr.shape) != shape or str(arr.dtype) != dtype or tuple(arr.chunks) != chunks:
            out.append(f"array {name!r} is {list(arr.shape)} {arr.dtype} in chunks "
                       f"{list(arr.chunks)}, expected {list(shape)} {dtype} in chunks "
                       f"{list(chunks)}")
    try:
        sim = group[_SIM]
    except KeyError:
        return out
    info = dict(sim.attrs)
    if tuple(sim.shape) != (C, C):
        out.append(f"similarity is {list(sim.shape)}, expected [{C}, {C}]")
    if info.get("metric") not in SIMILARITY_METRICS:
        out.append(f"similarity metric is {info.get('metric')!r}, expected one of "
                   f"{', '.join(SIMILARITY_METRICS)}")
    if info.get("state") == "ready" and info.get("source_fingerprint") != meta.get("fingerprint"):
        out.append(f"similarity is stale: computed from fingerprint "
                   f"{info.get('source_fingerprint')!r}, the store's is "
                   f"{meta.get('fingerprint')!r}")
    k = info.get("top_k")
    for name in (_SIM_INDEX, _SIM_VALUE):
        present = name in group
        if k and (not present or tuple(group[name].shape) != (C, k)):
            out.append(f"{name} is {list(group[name].shape) if present else 'missing'}, "
                       f"expected [{C}, {k}]")
    return out
