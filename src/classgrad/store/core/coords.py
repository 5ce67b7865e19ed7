"""Format 3's metadata for xarray and dask users: coordinates, per-array attributes, consolidation.

Holds ``array_attributes`` (name -> the attributes a format-3 array carries: ``long_name``,
``description``; ``grads`` also ``true_values`` and ``columns``), ``coordinate_values`` (name ->
the values of each coordinate array of a spec), ``write_coordinates`` (creates them, at store
creation), ``coordinates_attr`` (the group attribute naming the auxiliary coordinates),
``consolidated_root`` and ``consolidate`` (the group's metadata with every node's copied in,
and its rewriting), and the checks of ``classgrad verify`` on them: ``coordinate_problems``,
``consolidated_problems``. The layout itself is described in ``format``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import zarr

from classgrad.errors import StoreError
from classgrad.store.core.format import (
    ARRAY_DIMS,
    CLASS_ID,
    CLASS_NAME,
    PARAM,
    PARAM_ID,
    PARAM_OFFSET,
    PARAM_SHAPE,
    PARAM_SIZE,
    StoreSpec,
    codecs,
    names_digest,
)
from classgrad.store.core.location import Location, unreadable

ZARR_JSON = "zarr.json"

_TRUE_VALUES = "classgrad.open_dataset(url) gives float32 true values lazily (xarray, dask)"


def _grads_attributes(spec: StoreSpec) -> dict:
    if spec.dtype == "bfloat16":
        true = (
            "stored as uint16: the bits of bfloat16 values (the high half of float32). True values: "
            "(grads.astype(uint32) << 16).view(float32) * row_scale[:, None]; " + _TRUE_VALUES
        )
    elif spec.dtype == "float16":
        true = "stored as float16, each row scaled: true values = grads * row_scale[:, None]; " + _TRUE_VALUES
    else:
        true = "stored as float32: the stored values are the true values (row_scale is 1)"
    if spec.projection is not None:
        columns = (
            f"projected rows ({spec.projection.get('kind', 'projection')}, {spec.dim} columns): a column "
            f"is no parameter's, so the store has no column -> parameter mapping (no param coordinates)"
        )
    else:
        columns = (
            "the selected parameters, flattened and concatenated in row order; coordinate param "
            "(name, with param_offset, param_size, param_shape) and param_id (each column's position in param)"
        )
    return {
        "long_name": "per-class gradient",
        "description": "row i: gradient of class class_id[i]'s loss with respect to the parameters (columns)",
        "true_values": true,
        "stored_dtype": spec.dtype,
        "columns": columns,
        "missing": "NaN (bfloat16: bits 0x7FC0) where never written; rows of shards not marked in "
        "shard_done are not finished",
    }


def array_attributes(spec: StoreSpec) -> dict[str, dict]:
    """name -> attributes of each array a format-3 store is created with."""
    return {
        "grads": _grads_attributes(spec),
        "row_scale": {
            "long_name": "row scale",
            "description": "true row = stored row * row_scale (power of two; 1 for float32 stores)",
        },
        "loss": {"long_name": "class loss", "description": f"L_c at the model's parameters ({spec.loss_kind})"},
        "count": {"long_name": "probe samples", "description": "probe samples behind each row (-1: not written)"},
        "shard_done": {
            "long_name": "shard done",
            "description": f"1 once every row of the work shard (rows [s * {spec.shard_rows}, (s + 1) * "
            f"{spec.shard_rows})) is stored",
        },
        CLASS_ID: {"long_name": "class id", "description": "the class of each row"},
        CLASS_NAME: {"long_name": "class name", "description": "the name of each row's class"},
        PARAM: {"long_name": "parameter", "description": "parameter names, in row order"},
        PARAM_OFFSET: {"long_name": "parameter offset", "description": "first column of each parameter"},
        PARAM_SIZE: {"long_name": "parameter size", "description": "number of columns of each parameter"},
        PARAM_SHAPE: {"long_name": "parameter shape", "description": "each parameter's shape, as JSON"},
        PARAM_ID: {
            "long_name": "parameter of the column",
            "description": "position in param of each column's parameter: "
            "grads.where(param_id == i) keeps parameter i's columns",
        },
    }


def coordinate_values(spec: StoreSpec) -> dict[str, np.ndarray]:
    """name -> values of each coordinate array of a format-3 store made from ``spec``: class ids
    always, class names when known, the param* arrays when rows are not projected."""
    C = spec.num_classes
    ids = np.arange(C, dtype=np.int64) if spec.class_ids is None else np.asarray(spec.class_ids, dtype=np.int64)
    out: dict[str, np.ndarray] = {CLASS_ID: ids}
    if spec.class_names is not None:
        out[CLASS_NAME] = np.array(spec.class_names, dtype=object)
    if spec.layout:
        sizes = np.array([e.size for e in spec.layout], dtype=np.int64)
        out[PARAM] = np.array([e.name for e in spec.layout], dtype=object)
        out[PARAM_OFFSET] = np.array([e.offset for e in spec.layout], dtype=np.int64)
        out[PARAM_SIZE] = sizes
        out[PARAM_SHAPE] = np.array([json.dumps(list(e.shape)) for e in spec.layout], dtype=object)
        id_dtype = np.int16 if len(spec.layout) <= np.iinfo(np.int16).max else np.int32
        out[PARAM_ID] = np.repeat(np.arange(len(spec.layout), dtype=id_dtype), sizes)
    return out


def coordinates_attr(names: list[str] | tuple[str, ...]) -> str:
    """The group's ``coordinates`` attribute: the coordinate arrays that are no dimension's own
    (xarray reads them as coordinates, not data variables)."""
    return " ".join(n for n in names if ARRAY_DIMS[n] != (n,))


def write_coordinates(group: zarr.Group, spec: StoreSpec) -> list[str]:
    """Create and fill the coordinate arrays of a new format-3 store; returns their names."""
    attrs = array_attributes(spec)
    values = coordinate_values(spec)
    for name, data in values.items():
        strings = data.dtype == object
        # param_id follows grads' column chunks (a D-long array); the others are one chunk.
        chunks = (spec.col_chunk,) if name == PARAM_ID else (max(data.size, 1),)
        arr = group.create_array(
            name,
            shape=data.shape,
            chunks=chunks,
            dtype=str if strings else data.dtype,
            fill_value="" if strings else -1,
            compressors=codecs(spec.codec),
            dimension_names=ARRAY_DIMS[name],
            attributes=attrs[name],
        )
        arr[...] = data
    return list(values)


def coordinate_problems(group: zarr.Group, spec: StoreSpec) -> list[str]:
    """Problems of a format-3 store's coordinate arrays against its metadata (``classgrad
    verify``): each expected one present, with the dimension names and values it should have."""
    out = []
    for name, expected in coordinate_values(spec).items():
        try:
            node = group.get(name)
        except Exception as exc:  # a truncated or garbled zarr.json of its own
            out.append(f"coordinate {name!r} cannot be opened ({name}/{ZARR_JSON}): {type(exc).__name__}: {exc}")
            continue
        if not isinstance(node, zarr.Array):
            out.append(f"coordinate {name!r} is missing (format 3 writes it at creation)")
            continue
        dims = tuple(getattr(node.metadata, "dimension_names", None) or ())
        try:
            stored = np.asarray(node[...])
        except Exception as exc:
            out.append(f"coordinate {name!r} cannot be read: {type(exc).__name__}: {exc}")
            continue
        same = stored.shape == expected.shape and bool(np.all(stored.astype(expected.dtype) == expected))
        if not same or dims != ARRAY_DIMS[name]:
            out.append(f"coordinate {name!r} differs from the store's metadata (values or dimensions {list(dims)})")
    return out


def recorded_names(group: zarr.Group, record: dict) -> tuple[tuple[str, ...] | None, str | None]:
    """Format 4's class names from their coordinate array, checked against the attributes'
    ``record`` ({array, count, sha256}): (the names, None), or (None, what is wrong with them,
    in words starting with the array's name): what the store's reader and ``verify`` both use."""
    try:
        node = group.get(CLASS_NAME)
        names = tuple(str(n) for n in np.asarray(node[...]).tolist()) if isinstance(node, zarr.Array) else None
    except Exception as exc:  # a truncated zarr.json, a damaged chunk
        return None, f"coordinate {CLASS_NAME!r} cannot be read: {type(exc).__name__}: {exc}"
    if names is None:
        return None, f"coordinate {CLASS_NAME!r} is missing (format 4 keeps the class names there)"
    if len(names) != record.get("count") or names_digest(names) != record.get("sha256"):
        return None, f"coordinate {CLASS_NAME!r} differs from the store's metadata (the names' digest)"
    return names, None


def consolidated_problems(loc: Location) -> list[str]:
    """Problems of a format-3 store's consolidated metadata: missing, or not what its nodes
    hold now (``classgrad verify --repair`` rewrites it)."""
    try:
        fresh = consolidated_root(loc)
    except StoreError as exc:  # a node's zarr.json cannot be read: said once, by its own check too
        return [f"consolidated metadata not checked: {exc}"]
    root = loc.read_bytes(ZARR_JSON)
    if fresh is None or root is None:
        return []
    held = json.loads(root).get("consolidated_metadata")
    if not isinstance(held, dict):
        return [
            "consolidated metadata is missing (xarray.open_zarr warns and lists the store); "
            "`classgrad verify --repair` writes it"
        ]
    now = json.loads(fresh)["consolidated_metadata"]["metadata"]
    old: dict = held["metadata"] if isinstance(held.get("metadata"), dict) else {}
    stale = sorted(n for n in set(now) | set(old) if now.get(n) != old.get(n))
    if stale:
        return [
            f"consolidated metadata is stale for {', '.join(stale)} (readers of it see other arrays than "
            f"the store holds); `classgrad verify --repair` rewrites it"
        ]
    return []


def consolidated_root(loc: Location) -> bytes | None:
    """The group's ``zarr.json`` with ``consolidated_metadata`` holding every node of the store
    (each child's ``zarr.json`` as it is, groups with an empty consolidated block): what
    ``zarr.consolidate_metadata`` writes, made from one listing of the store's top level rather
    than a walk of the hierarchy, which would try every shard record as a node and warn about
    each. None when there is no group."""
    root = loc.read_bytes(ZARR_JSON)
    if root is None:
        return None
    meta = _parsed(loc, ZARR_JSON, root)
    nodes = {}
    for name in _children(loc):
        data = loc.read_bytes(f"{name}/{ZARR_JSON}")
        if data is None:
            continue  # a file, or a directory that is no Zarr node
        node = _parsed(loc, f"{name}/{ZARR_JSON}", data)
        if node.get("node_type") == "group":
            node.setdefault("consolidated_metadata", _inline({}))  # its records are not nodes
        nodes[name] = node
    meta["consolidated_metadata"] = _inline(nodes)
    return json.dumps(meta, indent=2).encode()


def _parsed(loc: Location, key: str, data: bytes) -> dict:
    """A metadata document, or one line naming the file that cannot be read."""
    try:
        return json.loads(data)
    except ValueError as exc:  # truncated or garbled (UnicodeDecodeError is a ValueError too)
        raise unreadable(loc.url, key, exc) from None


def _children(loc: Location) -> list[str]:
    """Names at the top level of the store that may be nodes (locally: its directories), sorted."""
    if loc.local:
        return sorted(n for n in os.listdir(loc.path) if os.path.isdir(os.path.join(loc.path, n)))
    loc.fs.invalidate_cache(loc.path)  # s3fs caches listings; a stale one would miss an array
    found = loc.fs.ls(loc.path, detail=False)
    return sorted({str(p).rstrip("/").rsplit("/", 1)[-1] for p in found} - {ZARR_JSON})


def _inline(nodes: dict) -> dict:
    return {"kind": "inline", "must_understand": False, "metadata": nodes}


def consolidate(loc: Location) -> None:
    """Rewrite the store's consolidated metadata, so that ``xarray.open_zarr(url)`` needs one
    read and warns about nothing (zarr-python and xarray read it; other readers ignore it). The
    group's ``zarr.json`` is replaced whole (locally through a renamed temporary file), so a
    reader never sees half of it. Written here rather than by ``zarr.consolidate_metadata``,
    which lists every shard record as a possible node and warns about each one, besides
    warning that consolidated metadata is not in the Zarr v3 specification."""
    data = consolidated_root(loc)
    if data is None:
        raise StoreError(f"no classgrad store at {loc.url} to consolidate")
    loc.write_bytes(ZARR_JSON, data)
