"""The store format: key names, array layout, metadata, and the checks that go with them.

Holds ``FORMAT_VERSION`` (and ``READABLE_VERSIONS``), the key and array names (``ATTR_KEY``,
the lease's and the deletion marker's ``*_SUFFIX``, ``LEGACY_LEASE_KEY``, ``ARRAYS``, the
similarity arrays' names and ``SIMILARITY_METRICS``), ``StoreSpec`` (everything needed to create
a store, checked on construction), ``spec_to_meta`` / ``spec_from_meta`` (the spec <-> the
``attributes["classgrad"]`` JSON), ``array_table`` (name -> shape, chunks, dtype), ``codecs``
(each array's codec pipeline), ``check_layout`` (the parameter layout's consistency),
``check_same`` (may an existing store be reopened by this spec), ``metadata_digest`` and
``check_metadata_digest`` (over ``DIGESTED_KEYS``), and (format 3) the dimension names by
version (``array_dims``) and the coordinate arrays' names (``COORD_ARRAYS``...). Only this
package knows these names; this module is where they are written down.

Layout of a store (a Zarr v3 group)::

    zarr.json         group metadata; all classgrad metadata under attributes["classgrad"];
                      (format 3) attributes["coordinates"] names the auxiliary coordinates (for
                      xarray) and "consolidated_metadata" holds every array's metadata
    grads/            (C, D) float32 | float16 | uint16 (bfloat16 bits), chunks (row_chunk,
                      col_chunk)
    row_scale/        (C,) float32, chunks (row_chunk,): true row = stored row * row_scale
    loss/             (C,) float32, chunks (row_chunk,): L_c at theta
    count/            (C,) int64, chunks (row_chunk,): probe samples behind row c
    shard_done/       (num_shards,) uint8, chunks (1,): 1 once every row of the shard is stored
    shard_records/<shard>.json  (format 2) written just before the shard's shard_done mark:
                      {"shard", "rows", "digest", "chunks": {key: [size, digest]}} for every
                      chunk object of its rows in grads, row_scale, loss and count; digest =
                      xxh3-128 (records made before: blake2b-128, as "digest" names it) of the
                      key, a NUL byte and the object's bytes (as its writer
                      wrote them); "generation": the store's (stores that have one); deleted
                      when the shard is unmarked. Every read checks chunks against it.
  written by ``classgrad similarity`` (optional; replaced whole by each run):
    similarity/       (C, C) float32, chunks (chunk_rows, C) (row blocks; chunk_rows divides
                      row_chunk), fill NaN: cosine or dot product of rows i and j; only in a
                      dense result. The result's attributes (on this array, or on
                      similarity_topk_index when the result is top-k only): metric, dense
                      (absent in results written before top-k-only ones existed: dense), state
                      ("computing" until the run finishes, then "ready"; readers refuse anything
                      else), top_k, chunk_rows, source_fingerprint (the store's fingerprint when
                      computed), run_id, timings
    similarity_topk_index/  (C, top_k) int64, chunks (chunk_rows, top_k) (top-k only:
                      chunk_rows is a multiple of row_chunk), fill -1: row indices of each row's
                      most similar rows, best first, ties by lower index, self excluded (absent
                      when top_k is 0, which only a dense result allows)
    similarity_topk_value/  (C, top_k) float32: their similarity values
  coordinates (format 3; written at creation, never changed; crc32c like the others):
    class_id/         (C,) int64, one chunk: the class of each row (dimension coordinate)
    class_name/       (C,) string (Zarr's variable-length UTF-8), only when names are known
    param/            (P,) string: parameter names in row order (dimension coordinate); with
    param_offset/ param_size/  (P,) int64 and param_shape/ (P,) string ("[32, 32]", JSON)
    param_id/         (D,) int16 (int32 past 32,767 parameters), chunks (col_chunk,): the
                      position in param of each column's parameter
                      (no param* arrays in a projected store: its columns have no parameter;
                      grads' attribute "columns" says so)

Next to the store, outside what an overwrite deletes (siblings of its directory or prefix:
``/data/s.zarr`` has ``/data/s.zarr.classgrad-lease.json``; a store at a bucket's root keeps them
under the root, as ``.classgrad-lease.json``...)::

    STORE.classgrad-lease.json  the driver's lease (plain JSON: run_id, host, pid, started,
                      heartbeat, ttl_s, info), taken before the store is created or deleted:
                      created only if absent, replaced only if unchanged (local: exclusive
                      create plus an fcntl lock on STORE.classgrad-lease.lock, which stays;
                      S3: If-None-Match / If-Match conditional PUTs)
    STORE.classgrad-deleting    present while an overwrite deletes the store; a rerun finishes
                      the deletion (only the keys a classgrad store holds) before creating
  Stores written before keep ``lease.json`` inside (``LEGACY_LEASE_KEY``); deletion removes it.

Dimension names (format 3): ``grads`` (class_id, column), the per-row arrays and
``class_name`` (class_id,), ``shard_done`` (shard,), the param* arrays (param,), ``param_id``
(column,), ``similarity`` (class_id, other_class_id), the top-k arrays (class_id, neighbour).
Formats 1 and 2 name them class (a Python keyword), param, other_class, and have no coordinates
nor consolidated metadata; they are read as they are and keep their names when resumed
(``array_dims``). Every array made at creation (format 3) has attributes ``long_name`` and
``description``; grads also ``true_values`` (how to get them: ``classgrad.open_dataset(url)``,
or the formulas below) and ``columns``. Consolidated metadata (format 3) is rewritten whenever
metadata changes: by the driver (creation, the recorded identity, the end of every run), by
``SimilarityArrays.begin`` and ``finish``, and by ``classgrad verify --repair`` when it is
missing or stale (``GradStore.consolidate``); rows and done marks are chunk data, so the
actors never touch it. Row i holds class ``class_ids[i]``.

Fill values mark what was never written: NaN for
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
array exists, then "ready"); ``generation`` (a random id per creation of a store at its location,
named by every shard record: stores made before it have none); ``num_classes``, ``dim``, ``shard_rows``, ``num_shards``,
``row_chunk``, ``col_chunk``; ``dtype`` (float32 | float16 | bfloat16), ``storage_dtype``,
``scaling`` and ``encoding`` (plain-text descriptions of the two rules below); ``codec`` and
``checksum``; ``sharded``; ``class_ids`` (null means row i is class i) and ``class_names``
(or null; format 4: {array, count, sha256}, the names themselves in the ``class_name``
coordinate array); ``layout``  (list of {name, shape, offset, size}; empty when projected);
``projection`` (or null); ``loss_kind``; ``config`` (the job config, redacted by the caller);
``fingerprint``; ``identity`` (what the rows were computed from: digests of the model's
parameters and of the probe set, and the model's outputs on a few probe samples; JSON made and
compared by ``classgrad.workers.actor_runtime.identity``, null in stores made before it); ``versions``;
``runs`` (formats 1-3: run history, appended by the driver; format 4 keeps it as one object
per run, ``runs/<n>.json``); (format 2) ``metadata_digest`` ({keys, sha256}:
sha256 of the canonical JSON of those keys' values, set at creation, checked by
``classgrad verify``). Storage options
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
    xarray.open_zarr(path)                     # format 3: Dataset of stored values, coordinates
    classgrad.open_dataset(path)               # any format: lazy Dataset of float32 true values
    tensorstore.open({"driver": "zarr3",
                      "kvstore": {"driver": "file", "path": f"{path}/grads"}}).result()
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from classgrad.errors import ConfigMismatchError, StoreError, StoreMismatchError
from classgrad.store.core.encoding import TOP_EXP
from classgrad.store.core.params import ParamSlot

# 2: per-shard records (shard_records/) and the metadata digest; 3: dimension names that are
# identifiers, coordinate arrays, per-array attributes, consolidated metadata; 4: the class names
# only in their coordinate array (the attributes hold their count and digest) and the run
# history as one object per run (runs/), so that the group's zarr.json, which every actor reads,
# grows neither with C nor with runs. 1 to 3 are still read and resumed at their own version
# (see DESIGN.md).
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
RUNS_DIR = "runs"  # format 4: runs/<n>.json, one run's record each, n from 000000 on

ATTR_KEY = "classgrad"
LEASE_SUFFIX = ".classgrad-lease.json"
LEASE_LOCK_SUFFIX = ".classgrad-lease.lock"
DELETING_SUFFIX = ".classgrad-deleting"
LEGACY_LEASE_KEY = "lease.json"  # where stores written before kept the lease (inside the store)
ARRAYS = ("grads", "row_scale", "loss", "count", "shard_done")
# The coordinate arrays of format 3 (``coords`` writes them); aux ones are named in the group's
# "coordinates" attribute, so that xarray takes them as coordinates.
CLASS_ID, CLASS_NAME = "class_id", "class_name"
PARAM, PARAM_OFFSET, PARAM_SIZE, PARAM_SHAPE, PARAM_ID = (
    "param",
    "param_offset",
    "param_size",
    "param_shape",
    "param_id",
)
COORD_ARRAYS = (CLASS_ID, CLASS_NAME, PARAM, PARAM_OFFSET, PARAM_SIZE, PARAM_SHAPE, PARAM_ID)
COORDINATES_ATTR = "coordinates"
# Dimension names of format 3 (every array of the store; the similarity arrays' too).
ROW_DIM, COL_DIM, OTHER_ROW_DIM, NEIGHBOUR_DIM = "class_id", "column", "other_class_id", "neighbour"
ARRAY_DIMS = {
    "grads": (ROW_DIM, COL_DIM),
    "row_scale": (ROW_DIM,),
    "loss": (ROW_DIM,),
    "count": (ROW_DIM,),
    "shard_done": ("shard",),
    "similarity": (ROW_DIM, OTHER_ROW_DIM),
    "similarity_topk_index": (ROW_DIM, NEIGHBOUR_DIM),
    "similarity_topk_value": (ROW_DIM, NEIGHBOUR_DIM),
    CLASS_ID: (ROW_DIM,),
    CLASS_NAME: (ROW_DIM,),
    PARAM: (PARAM,),
    PARAM_OFFSET: (PARAM,),
    PARAM_SIZE: (PARAM,),
    PARAM_SHAPE: (PARAM,),
    PARAM_ID: (COL_DIM,),
}
# Formats 1 and 2 ("class" is a Python keyword: ``ds.isel(class=0)`` does not parse).
_LEGACY_DIMS = {"class_id": "class", "column": "param", "other_class_id": "other_class"}


def array_dims(version: int) -> dict[str, tuple[str, ...]]:
    """name -> dimension names of the arrays of a store of format ``version``."""
    if version >= 3:
        return dict(ARRAY_DIMS)
    return {name: tuple(_LEGACY_DIMS.get(d, d) for d in dims) for name, dims in ARRAY_DIMS.items()}


STORAGE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
CODECS = ("none", "zstd", "blosc")
# Attributes that must match, besides the fingerprint, for a store to be reopened.
STRUCTURE_KEYS = (
    "num_classes",
    "dim",
    "shard_rows",
    "row_chunk",
    "col_chunk",
    "dtype",
    "codec",
    "sharded",
    "layout",
    "class_ids",
    "projection",
)
OVERWRITE_HINT = "--set store.overwrite=true"
# What ``metadata_digest`` covers (format 2): the layout, the rows' classes, shapes, chunks and
# dtypes; not the run history, the config text or analysis results, which change legitimately.
DIGESTED_KEYS = STRUCTURE_KEYS + ("num_shards", "storage_dtype", "class_names", "loss_kind")

# The downstream results written by ``classgrad similarity``.
SIMILARITY_METRICS = ("cosine", "dot")
SIM = "similarity"
SIM_INDEX = "similarity_topk_index"
SIM_VALUE = "similarity_topk_value"
RESULT_ARRAYS = (SIM, SIM_INDEX, SIM_VALUE)  # the matrix first: deleted first on a rerun


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
    layout: tuple[ParamSlot, ...] = ()
    class_ids: tuple[int, ...] | None = None
    class_names: tuple[str, ...] | None = None
    loss_kind: str = ""
    projection: dict | None = None
    config: dict = field(default_factory=dict)
    fingerprint: str = ""
    identity: dict | None = None  # what the rows are computed from (workers/actor_runtime/identity.py)
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
            raise bad("shard_rows", f"({self.shard_rows}) must be a multiple of row_chunk ({self.row_chunk})")
        put("col_chunk", min(self.col_chunk, self.dim))
        if self.dtype not in STORAGE_DTYPES:
            raise bad("dtype", f"must be one of {', '.join(STORAGE_DTYPES)}, got {self.dtype!r}")
        if self.codec not in CODECS:
            raise bad("codec", f"must be one of {', '.join(CODECS)}, got {self.codec!r}")
        put("sharded", bool(self.sharded))
        put("layout", tuple(ParamSlot.of(e) for e in self.layout))
        # The checks ``classgrad verify`` runs on stored metadata; each problem starts with
        # the field it is about ("layout ...", "projection ...").
        problems = check_layout([e.to_dict() for e in self.layout], self.projection, self.dim)
        if problems:
            raise StoreError(f"store spec: {problems[0]}")
        if self.class_ids is not None:
            ids = tuple(int(i) for i in self.class_ids)
            if len(ids) != self.num_classes:
                raise bad("class_ids", f"has {len(ids)} entries, expected num_classes ({self.num_classes})")
            if len(set(ids)) != len(ids):
                raise bad("class_ids", "has duplicates")
            put("class_ids", ids)
        if self.class_names is not None:
            names = tuple(str(n) for n in self.class_names)
            if len(names) != self.num_classes:
                raise bad("class_names", f"has {len(names)} entries, expected num_classes ({self.num_classes})")
            put("class_names", names)
        for name in ("config", "versions", "projection", "identity"):
            try:
                json.dumps(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise bad(name, f"is not JSON-serializable: {exc}") from None

    @property
    def num_shards(self) -> int:
        return -(-self.num_classes // self.shard_rows)

    @property
    def write_align(self) -> int:
        """Rows a write must start at a multiple of (and cover): the unit stored as one object."""
        return self.shard_rows if self.sharded else self.row_chunk

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Rows [start, stop) of a work shard; the last one may be short."""
        if not 0 <= shard < self.num_shards:
            raise StoreError(f"shard {shard} out of range [0, {self.num_shards})")
        start = shard * self.shard_rows
        return start, min(start + self.shard_rows, self.num_classes)


def spec_to_meta(spec: StoreSpec) -> dict:
    """The ``attributes["classgrad"]`` of a new store made from ``spec`` (state "creating")."""
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
        "storage_dtype": STORAGE_DTYPES[spec.dtype],
        "scaling": (f"per-row power-of-two row_scale: true row = stored row * row_scale (max |stored| < 2**{TOP_EXP})")
        if low
        else "none (row_scale = 1)",
        "encoding": ("bfloat16 stored as uint16 bits, high half of float32 (round to nearest even)")
        if spec.dtype == "bfloat16"
        else spec.dtype,
        "codec": spec.codec,
        "checksum": "crc32c",
        "sharded": spec.sharded,
        "class_ids": list(spec.class_ids) if spec.class_ids is not None else None,
        "class_names": names_record(spec.class_names),
        "layout": [e.to_dict() for e in spec.layout],
        "projection": spec.projection,
        "loss_kind": spec.loss_kind,
        "config": spec.config,
        "fingerprint": spec.fingerprint,
        "identity": spec.identity,
        "versions": {"numpy": np.__version__, "zarr": zarr.__version__, **spec.versions},
    }
    meta["metadata_digest"] = metadata_digest(json.loads(json.dumps(meta)), DIGESTED_KEYS)
    # Normalise through JSON (tuples -> lists) so comparisons with stored attributes are exact.
    return json.loads(json.dumps(meta))


def names_digest(names: Any) -> str:
    """sha256 hex of class names (their JSON list, compact)."""
    return hashlib.sha256(json.dumps([str(n) for n in names], separators=(",", ":")).encode()).hexdigest()


def names_record(names: tuple[str, ...] | None) -> dict | None:
    """What format 4's attributes say of the class names, which live in the ``class_name``
    coordinate array: the array, how many, and their digest (None: the classes have no names)."""
    if names is None:
        return None
    return {"array": CLASS_NAME, "count": len(names), "sha256": names_digest(names)}


def metadata_digest(meta: dict, keys: tuple | list) -> dict:
    """``{"keys": [...], "sha256": hex}``: the digest of ``meta``'s values at ``keys``."""
    text = json.dumps({str(k): meta.get(str(k)) for k in keys}, sort_keys=True, separators=(",", ":"))
    return {"keys": list(keys), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def check_metadata_digest(meta: dict) -> list[str]:
    """Problems of a format-2 store's recorded ``metadata_digest`` against its metadata."""
    recorded = meta.get("metadata_digest")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("keys"), list):
        return ["metadata_digest is missing or malformed (format 2 records it at creation)"]
    if metadata_digest(meta, recorded["keys"])["sha256"] != recorded.get("sha256"):
        return [
            f"metadata_digest does not match the metadata ({', '.join(map(str, recorded['keys']))}): "
            f"the layout, class ids or array structure changed after the store was created"
        ]
    return []


def spec_from_meta(meta: dict) -> StoreSpec:
    """The spec a store was made from, read back from its attributes."""
    return StoreSpec(
        num_classes=meta["num_classes"],
        dim=meta["dim"],
        shard_rows=meta["shard_rows"],
        row_chunk=meta["row_chunk"],
        col_chunk=meta["col_chunk"],
        dtype=meta["dtype"],
        codec=meta["codec"],
        sharded=meta["sharded"],
        layout=tuple(ParamSlot.of(e) for e in meta["layout"]),
        class_ids=tuple(meta["class_ids"]) if meta["class_ids"] is not None else None,
        # Format 4 keeps the names in their coordinate array: ``GradStore.class_names`` reads them.
        class_names=tuple(meta["class_names"]) if isinstance(meta["class_names"], list) else None,
        loss_kind=meta["loss_kind"],
        projection=meta["projection"],
        config=meta["config"],
        fingerprint=meta["fingerprint"],
        identity=meta.get("identity"),  # absent in stores made before it was recorded
        versions=meta["versions"],
    )


def codecs(codec: str) -> list:
    """The compressors of an array stored with ``codec``; the crc32c checksum always last."""
    compressors: list = []
    if codec == "zstd":
        compressors.append(ZstdCodec(level=3))
    elif codec == "blosc":
        compressors.append(BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"))
    compressors.append(Crc32cCodec())  # last, so the stored bytes themselves are checked
    return compressors


def array_table(
    num_classes: int, dim: int, row_chunk: int, col_chunk: int, num_shards: int, storage_dtype: str
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]:
    """name -> (shape, chunks, dtype) of a store's arrays, in ``ARRAYS`` order: what
    ``create_store`` makes and ``check_metadata`` expects."""
    C, rc = num_classes, row_chunk
    return {
        "grads": ((C, dim), (rc, col_chunk), storage_dtype),
        "row_scale": ((C,), (rc,), "float32"),
        "loss": ((C,), (rc,), "float32"),
        "count": ((C,), (rc,), "int64"),
        "shard_done": ((num_shards,), (1,), "uint8"),
    }


def fill_values(dtype: str) -> dict[str, float]:
    """name -> the fill value of each of a store's arrays (what was never written): NaN rows and
    losses (bfloat16's NaN bits 0x7FC0), a count of -1, not done."""
    return {
        "grads": 0x7FC0 if dtype == "bfloat16" else math.nan,
        "row_scale": math.nan,
        "loss": math.nan,
        "count": -1,
        "shard_done": 0,
    }


def array_problems(arrays: dict[str, Any], spec: StoreSpec) -> list[str]:
    """How the arrays as opened (``zarr.Array``s by name) differ from what ``spec`` made them:
    shape, chunks, dtype, fill value (a hand-edited ``zarr.json``: a fill value of 0 read a
    deleted chunk as zero rows, a shrunk shape returned fewer columns)."""
    table = array_table(
        spec.num_classes, spec.dim, spec.row_chunk, spec.col_chunk, spec.num_shards, STORAGE_DTYPES[spec.dtype]
    )
    fills = fill_values(spec.dtype)
    out = []
    for name, (shape, chunks, dtype) in table.items():
        arr = arrays[name]
        fill = arr.metadata.fill_value
        fill = float(fill) if isinstance(fill, (int, float, np.number)) else fill
        same_fill = (math.isnan(fills[name]) and isinstance(fill, float) and math.isnan(fill)) or fill == fills[name]
        if tuple(arr.shape) != shape or tuple(arr.chunks) != chunks or str(arr.dtype) != dtype or not same_fill:
            out.append(
                f"array '{name}' is {list(arr.shape)} {arr.dtype} in chunks {list(arr.chunks)}, fill {fill!r}; "
                f"the store's metadata makes it {list(shape)} {dtype} in chunks {list(chunks)}, fill {fills[name]!r}"
            )
    return out


def check_layout(layout: Any, projection: Any, dim: int) -> list[str]:
    """Problems of a stored layout (list of dicts) and projection for rows of ``dim`` columns."""
    if projection is not None:
        out = [] if isinstance(projection, dict) else [f"projection is {projection!r}, expected a mapping"]
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
            out.append(
                f"layout entry {name!r} starts at {offset}, expected {expected} (entries "
                f"must be contiguous, in row order)"
            )
        if size != math.prod(shape):
            out.append(f"layout entry {name!r} has size {size} but shape {shape}")
        if name in seen:
            out.append(f"layout names {name!r} twice")
        seen.add(name)
        expected = offset + size
    if expected != dim:
        out.append(f"layout sizes add up to {expected}, not dim ({dim})")
    return out


def check_same(meta: dict, spec: StoreSpec, url: str) -> None:
    """Refuse to reopen a store made by another config (fingerprint) or of another structure."""
    old_fp = meta.get("fingerprint")
    if old_fp != spec.fingerprint:
        raise ConfigMismatchError(
            f"store at {url} was made by another config (its fingerprint {old_fp!r}, this "
            f"config's {spec.fingerprint!r}); use another store.url, or replace it with "
            f"{OVERWRITE_HINT}"
        )
    new = spec_to_meta(spec)
    differ = [k for k in STRUCTURE_KEYS if meta.get(k) != new[k]]
    if differ:
        detail = _projection_change(meta.get("projection"), new.get("projection")) if "projection" in differ else ""
        raise StoreMismatchError(
            f"store at {url} has this config's fingerprint {old_fp!r} but a different "
            f"{', '.join(differ)}{detail}; replace it with {OVERWRITE_HINT}"
        )


def _projection_change(old: Any, new: Any) -> str:
    """The projection settings that differ between two records (e.g. a default that changed:
    ``rest`` was ``dense`` before ``sketch`` became the default), as `` (rest: store dense, this
    config sketch: set it to resume)``."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return ""
    keys = ("structure", "kind", "rest", "allocation", "low_rank", "dim", "seed")
    changed = [f"{k}: store {old.get(k)!r}, this config {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return f" (projection {'; '.join(changed)}: set those to resume it)" if changed else ""
