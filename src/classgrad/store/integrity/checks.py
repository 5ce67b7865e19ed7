"""The structured metadata checks of ``classgrad verify``: a store's metadata, not trusted.

Holds ``check_metadata`` (one line per problem in the format version (and, from format 2, the
metadata digest), state, sizes, dtype,
parameter layout, class ids and names, fingerprint, the arrays' shapes, dtypes and chunks, (format
3) the coordinate arrays and the consolidated metadata, and
the similarity result's). The checks of the chunks themselves are in ``scan``.
"""

from __future__ import annotations

import zarr

from classgrad.errors import StoreError, first_line
from classgrad.store.core.coords import consolidated_problems, coordinate_problems, recorded_names
from classgrad.store.core.format import (
    READABLE_VERSIONS,
    SIM,
    SIM_INDEX,
    SIM_VALUE,
    SIMILARITY_METRICS,
    STORAGE_DTYPES,
    array_table,
    check_layout,
    check_metadata_digest,
    spec_from_meta,
)
from classgrad.store.core.location import Location, probe


def check_metadata(url: str, *, storage_options: dict | None = None) -> list[str]:
    """Check a store's metadata without trusting it (``classgrad verify``): one line per
    problem, empty when consistent. Checks the format version and state; the sizes (number of
    shards, chunk alignment); dtype; the parameter layout (offsets contiguous from 0, sizes
    matching shapes, summing to dim, unique names; empty when projected); class ids and names
    (one per row, ids unique); a non-empty fingerprint; every array's shape, dtype and chunks;
    and, if present, the similarity's shape, metric and source fingerprint. Raises
    ``StoreError`` when there is no classgrad store at ``url`` at all."""
    loc = Location(url, storage_options)
    state, meta = probe(loc)
    if state == "empty":
        raise StoreError(f"no classgrad store at {url} ({loc.why_absent()})")
    if state == "other":
        raise StoreError(f"{url} holds something that is not a classgrad store")
    assert meta is not None  # probe gives the metadata of a 'creating' or 'ready' store
    problems: list[str] = []
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        problems.append(f"format_version is {version!r}, expected one of {', '.join(map(str, READABLE_VERSIONS))}")
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
        problems.append(
            f"num_shards is {meta['num_shards']}, but {C} classes in shards of "
            f"{meta['shard_rows']} make {-(-C // meta['shard_rows'])}"
        )
    if meta["shard_rows"] % meta["row_chunk"]:
        problems.append(f"shard_rows ({meta['shard_rows']}) is not a multiple of row_chunk ({meta['row_chunk']})")
    dtype = meta.get("dtype")
    if dtype not in STORAGE_DTYPES:
        problems.append(f"dtype is {dtype!r}, expected one of {', '.join(STORAGE_DTYPES)}")
    elif meta.get("storage_dtype") != STORAGE_DTYPES[dtype]:
        problems.append(
            f"storage_dtype is {meta.get('storage_dtype')!r}, expected {STORAGE_DTYPES[dtype]!r} for dtype {dtype}"
        )
    problems += check_layout(meta.get("layout"), meta.get("projection"), D)
    ids, names = meta.get("class_ids"), meta.get("class_names")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) != C:
            problems.append(
                f"class_ids has {len(ids) if isinstance(ids, list) else ids!r} entries, expected one per row ({C})"
            )
        elif not all(isinstance(i, int) for i in ids) or len(set(ids)) != C:
            problems.append("class_ids are not distinct integers")
    if isinstance(names, dict):  # format 4: a record of the class_name coordinate array
        if names.get("count") != C or not isinstance(names.get("sha256"), str):
            problems.append(f"class_names records {names.get('count')!r} names, expected one per row ({C})")
    elif names is not None and (not isinstance(names, list) or len(names) != C):
        problems.append(
            f"class_names has {len(names) if isinstance(names, list) else names!r} entries, expected one per row ({C})"
        )
    fingerprint = meta.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        problems.append(
            f"fingerprint is {fingerprint!r}: missing (a rerun could not tell whether the store was made by its config)"
        )
    problems += _check_arrays(loc, meta)
    if version in READABLE_VERSIONS and version >= 2:
        problems += check_metadata_digest(meta)
    if version in READABLE_VERSIONS and version >= 3:
        # The coordinates are checked against metadata found sound (else they would differ too).
        problems += (_check_coordinates(loc, meta) if not problems else []) + consolidated_problems(loc)
    return problems


def _check_coordinates(loc: Location, meta: dict) -> list[str]:
    """The coordinate arrays of format 3 against the metadata."""
    try:
        spec = spec_from_meta(meta)
        group = zarr.open_group(loc.zarr_store(read_only=True), mode="r", zarr_format=3, use_consolidated=False)
    except Exception as exc:
        return [f"cannot check the coordinates: {first_line(exc, with_type=True)}"]
    problems = coordinate_problems(group, spec)
    record = meta.get("class_names")
    if isinstance(record, dict):  # format 4: the names are the array's, checked by their digest
        _, problem = recorded_names(group, record)
        problems += [problem] if problem else []
    return problems


def _check_arrays(loc: Location, meta: dict) -> list[str]:
    C, D = meta["num_classes"], meta["dim"]
    expected = array_table(
        C,
        D,
        meta["row_chunk"],
        min(meta["col_chunk"], D),
        meta["num_shards"],
        STORAGE_DTYPES.get(meta.get("dtype", ""), "?"),
    )
    out = []
    try:
        group = zarr.open_group(loc.zarr_store(read_only=True), mode="r", zarr_format=3, use_consolidated=False)
    except Exception as exc:
        return [f"cannot open the group: {first_line(exc, with_type=True)}"]
    for name, (shape, chunks, dtype) in expected.items():
        try:
            arr = group[name]
        except KeyError:
            out.append(f"array {name!r} is missing")
            continue
        except ValueError as exc:  # a truncated or garbled zarr.json
            out.append(f"array {name!r}: its metadata ({name}/zarr.json) cannot be read ({first_line(exc)})")
            continue
        if not isinstance(arr, zarr.Array):
            out.append(f"array {name!r} is a group, not an array")
            continue
        if tuple(arr.shape) != shape or str(arr.dtype) != dtype or tuple(arr.chunks) != chunks:
            out.append(
                f"array {name!r} is {list(arr.shape)} {arr.dtype} in chunks "
                f"{list(arr.chunks)}, expected {list(shape)} {dtype} in chunks "
                f"{list(chunks)}"
            )
    # The result's attributes: on the matrix, or on the index table of a top-k-only result.
    sim = group[SIM] if SIM in group else None
    if sim is None:
        table = group[SIM_INDEX] if SIM_INDEX in group else None
        if not isinstance(table, zarr.Array) or "state" not in table.attrs:
            return out
        info = dict(table.attrs)
        if info.get("dense", True):
            out.append(f"{SIM} is missing although {SIM_INDEX} says the result is dense")
    elif not isinstance(sim, zarr.Array):
        out.append(f"{SIM} is a group, not an array")
        return out
    else:
        info = dict(sim.attrs)
        if tuple(sim.shape) != (C, C):
            out.append(f"similarity is {list(sim.shape)}, expected [{C}, {C}]")
    if info.get("metric") not in SIMILARITY_METRICS:
        out.append(f"similarity metric is {info.get('metric')!r}, expected one of {', '.join(SIMILARITY_METRICS)}")
    if info.get("state") == "ready" and info.get("source_fingerprint") != meta.get("fingerprint"):
        out.append(
            f"similarity is stale: computed from fingerprint "
            f"{info.get('source_fingerprint')!r}, the store's is "
            f"{meta.get('fingerprint')!r}"
        )
    k = info.get("top_k")
    if not k and not info.get("dense", True):
        out.append("similarity is top-k only with top_k 0")
    for name in (SIM_INDEX, SIM_VALUE):
        present = name in group
        if not k:
            continue
        node = group[name] if present else None
        if not isinstance(node, zarr.Array) or tuple(node.shape) != (C, k):
            found = list(node.shape) if isinstance(node, zarr.Array) else "a group" if present else "missing"
            out.append(f"{name} is {found}, expected [{C}, {k}]")
    return out
